"""The accelerators the planner estimates for: memory and its bandwidth, dense peak FLOP/s and link
bandwidths, from the vendors' datasheets (dense, no sparsity; link bandwidths one way, per GPU)."""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Accelerator:
    kind: str  # what jax's `device_kind` contains, e.g. 'NVIDIA A100-SXM4-40GB' holds 'A100' and '40GB'
    memory: float  # bytes of device memory
    bf16_flops: float
    fp8_flops: float
    nvlink: float  # bytes/s one way, GPU to GPU inside a node (over PCIe where there is no NVLink switch)
    network: float  # bytes/s one way, this GPU's share of the inter-node fabric (InfiniBand)
    hbm: float  # bytes/s between device memory and the cores
    per_node: int = 8
    marks: tuple[str, ...] = ()  # more words of `device_kind` that tell this part from others of its kind

    @property
    def label(self) -> str:
        """The part's name as printed: 'A100', 'A100 40GB', 'H100 PCIe'."""
        return " ".join((self.kind, *self.marks))


ACCELERATORS = {
    # A100 SXM 80GB: 312 TFLOP/s bf16, no FP8; HBM2e 2.0 TB/s; NVLink 3 600 GB/s both ways; one HDR 200 Gb/s
    # NIC per GPU.
    "a100-80gb": Accelerator("A100", 80 * GiB, 312e12, 312e12, nvlink=300e9, network=25e9, hbm=2.039e12),
    # A100 SXM 40GB: the same compute and links, half the memory, HBM2 at 1.56 TB/s.
    "a100-40gb": Accelerator("A100", 40 * GiB, 312e12, 312e12, nvlink=300e9, network=25e9, hbm=1.555e12,
                             marks=("40GB",)),  # fmt: skip
    # H100 SXM 80GB: 989 / 1979 TFLOP/s bf16 / fp8; HBM3 3.35 TB/s; NVLink 4 900 GB/s both ways; one NDR
    # 400 Gb/s NIC per GPU.
    "h100-80gb": Accelerator("H100", 79.6 * GiB, 989e12, 1979e12, nvlink=450e9, network=50e9, hbm=3.35e12),
    # H100 PCIe 80GB: 756 / 1513 TFLOP/s bf16 / fp8 (lower clocks and power); HBM2e 2.0 TB/s; no NVLink
    # switch, so GPUs of a node talk over PCIe Gen5 (64 GB/s one way); one NDR NIC per GPU assumed.
    "h100-pcie": Accelerator("H100", 79.6 * GiB, 756e12, 1513e12, nvlink=64e9, network=50e9, hbm=2.0e12,
                             marks=("PCIe",)),  # fmt: skip
    # H200 SXM 141GB: the H100's compute and links with more, faster memory (HBM3e 4.8 TB/s).
    "h200": Accelerator("H200", 140.4 * GiB, 989e12, 1979e12, nvlink=450e9, network=50e9, hbm=4.8e12),
}


def accelerator_of(device_kind: str) -> Accelerator | None:
    """The table's accelerator that a JAX `device_kind` names (e.g. 'NVIDIA H100 80GB HBM3' → h100-80gb,
    'NVIDIA H100 PCIe' → h100-pcie, 'NVIDIA A100-SXM4-40GB' → a100-40gb): the row with the most of
    its words in it. An A100 80GB PCIe reads as the SXM row, and a GH200 as the H200."""
    matches = [a for a in ACCELERATORS.values() if all(w in device_kind for w in (a.kind, *a.marks))]
    return max(matches, key=lambda a: len(a.marks), default=None)


# What the estimate assumes of a step (printed with every estimate).
MATMUL_EFFICIENCY = 0.75  # the fraction of peak large bf16/fp8 GEMMs reach
LINK_EFFICIENCY = 0.8  # the fraction of link bandwidth NCCL's ring collectives reach


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The fractions of peak the estimate assumes: these defaults, or what `python -m jaxllm.plan
    --sweep --fit OUT.json` fitted from a measured sweep (read back with `--efficiency OUT.json`)."""

    matmul: float = MATMUL_EFFICIENCY
    link: float = LINK_EFFICIENCY
    source: str = "defaults"  # where the figures come from, printed with the estimate


DEFAULT_EFFICIENCY = Efficiency()

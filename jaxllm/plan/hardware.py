"""The accelerators the planner estimates for: memory and its bandwidth, dense peak FLOP/s and link
bandwidths, from the vendors' datasheets (dense, no sparsity; link bandwidths one way, per GPU)."""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Accelerator:
    kind: str  # matched against jax's `device_kind`
    memory: float  # bytes of device memory
    bf16_flops: float
    fp8_flops: float
    nvlink: float  # bytes/s one way, GPU to GPU inside a node
    network: float  # bytes/s one way, this GPU's share of the inter-node fabric (InfiniBand)
    hbm: float  # bytes/s between device memory and the cores
    per_node: int = 8


ACCELERATORS = {
    # A100 SXM 80GB: 312 TFLOP/s bf16, no FP8; HBM2e 2.0 TB/s; NVLink 3 600 GB/s both ways; one HDR 200 Gb/s
    # NIC per GPU.
    "a100-80gb": Accelerator("A100", 80 * GiB, 312e12, 312e12, nvlink=300e9, network=25e9, hbm=2.039e12),
    # H100 SXM 80GB: 989 / 1979 TFLOP/s bf16 / fp8; HBM3 3.35 TB/s; NVLink 4 900 GB/s both ways; one NDR
    # 400 Gb/s NIC per GPU.
    "h100-80gb": Accelerator("H100", 79.6 * GiB, 989e12, 1979e12, nvlink=450e9, network=50e9, hbm=3.35e12),
    # H200 SXM 141GB: the H100's compute and links with more, faster memory (HBM3e 4.8 TB/s).
    "h200": Accelerator("H200", 140.4 * GiB, 989e12, 1979e12, nvlink=450e9, network=50e9, hbm=4.8e12),
}


def accelerator_of(device_kind: str) -> Accelerator | None:
    """The table's accelerator whose name a JAX `device_kind` contains (e.g. 'NVIDIA H100 80GB HBM3'):
    by its name only, so a PCIe or 40 GB part reads as the SXM 80 GB row, and a GH200 as the H200."""
    return next((a for a in ACCELERATORS.values() if a.kind in device_kind), None)


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

"""An estimated step time and MFU on a named accelerator, from peak FLOP/s, link bandwidths and the
planner's FLOPs and communication. The assumptions (`assumptions`) are printed with every estimate;
the matmul and link efficiencies are `hardware.Efficiency`'s defaults unless a fitted one is given."""

from __future__ import annotations

import dataclasses
import math

from jaxllm.config import MESH_AXES, RunConfig
from jaxllm.parallel import timetable
from jaxllm.plan.comm import Transfer, communication
from jaxllm.plan.flops import flops_per_token, recomputed_flops_per_token
from jaxllm.plan.hardware import DEFAULT_EFFICIENCY, Accelerator, Efficiency
from jaxllm.plan.memory import mesh_sizes


def _share(x: float) -> str:
    return f"{x:.0%}" if x >= 0.01 else f"{x:.3g}"


def assumptions(efficiency: Efficiency = DEFAULT_EFFICIENCY) -> tuple[str, ...]:
    fitted = "" if efficiency.source == "defaults" else f" (fitted: {efficiency.source})"
    return (
        f"matmuls at {_share(efficiency.matmul)} of the dense peak (FP8's where model.fp8 is on), recomputation "
        f"included{fitted}",
        f"collectives as rings at {_share(efficiency.link)} of the link: NVLink inside a node, the GPU's NIC across "
        f"nodes{fitted}",
        "mesh axes laid out data, fsdp, stage, tensor from outer to inner over nodes of 8 GPUs",
        "tensor and stage transfers exposed (they sit between dependent matmuls); data and fsdp transfers "
        "overlap compute and cost only what exceeds it",
        "a pipeline stage is idle for the bubble's share of the step",
    )


ASSUMPTIONS = assumptions()


@dataclasses.dataclass(frozen=True)
class Estimate:
    compute: float  # seconds of matmuls, bubble included
    exposed: float  # seconds of tensor and stage transfers
    overlapped: float  # seconds of data and fsdp transfers (hidden up to `compute`)
    model_flops: float  # per device per step
    peak: float  # the accelerator's dense bf16 FLOP/s

    @property
    def step(self) -> float:
        return self.compute + self.exposed + max(0.0, self.overlapped - self.compute)

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step * self.peak)

    @property
    def comm_share(self) -> float:
        """The step's share of transfers not hidden behind compute."""
        return (self.step - self.compute) / self.step


def link_bandwidth(axes: tuple[str, ...], sizes: dict[str, int], accelerator: Accelerator) -> float:
    """Bytes/s one way per GPU for a group over `axes`: NVLink when the group's devices sit in one
    node, else the NIC (mesh devices numbered with the last axis fastest)."""
    stride, span = 1, 1
    for axis in reversed(MESH_AXES):
        if axis in axes:
            span += (sizes[axis] - 1) * stride
        stride *= sizes[axis]
    return accelerator.nvlink if span <= accelerator.per_node else accelerator.network


def seconds(transfer: Transfer, sizes: dict[str, int], accelerator: Accelerator,
            efficiency: Efficiency = DEFAULT_EFFICIENCY) -> float:  # fmt: skip
    bandwidth = link_bandwidth(transfer.axes, sizes, accelerator) * efficiency.link
    return transfer.wire_bytes(sizes) / bandwidth


def estimate(cfg: RunConfig, accelerator: Accelerator, efficiency: Efficiency = DEFAULT_EFFICIENCY) -> Estimate:
    m, t = cfg.model, cfg.train
    sizes = mesh_sizes(cfg)
    devices, tokens = math.prod(sizes.values()), t.batch_size * t.seq_len
    model_flops = flops_per_token(m, t.seq_len) * tokens / devices
    hardware_flops = model_flops + recomputed_flops_per_token(cfg) * tokens / devices
    peak = accelerator.fp8_flops if m.fp8.enabled else accelerator.bf16_flops
    compute = hardware_flops / (peak * efficiency.matmul)
    if (schedule := cfg.parallel.pipeline) is not None:
        compute /= 1 - timetable.bubble_of(schedule)
    exposed = overlapped = 0.0
    for transfer in communication(cfg):
        time = seconds(transfer, sizes, accelerator, efficiency)
        if {"tensor", "stage"} & set(transfer.axes):
            exposed += time
        else:
            overlapped += time
    return Estimate(compute, exposed, overlapped, model_flops, accelerator.bf16_flops)

"""`--search`: every layout of a model on N GPUs (tensor × stage × fsdp × data × remat ×
microbatches × repeats × pipeline schedule × sequence parallelism) that passes the config's checks
and fits the device's memory with headroom, best estimated step time first."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

from jaxllm.config import CHUNKED_SCHEDULES, ConfigError, RunConfig, validate
from jaxllm.plan.estimate import Estimate, estimate
from jaxllm.plan.hardware import DEFAULT_EFFICIENCY, Accelerator, Efficiency
from jaxllm.plan.memory import memory

REMATS = ("none", "selective", "full", "group")  # `dots` keeps about what `selective` does; `offload` needs host memory
HEADROOM = 0.1  # of device memory left for the allocator's fragmentation, NCCL buffers, the framework


@dataclasses.dataclass(frozen=True)
class Layout:
    tensor: int
    stage: int
    fsdp: int
    data: int
    remat: str
    microbatches: int
    repeats: int
    sequence_parallel: bool
    schedule: str = "gpipe"

    def apply(self, cfg: RunConfig) -> RunConfig:
        """`cfg` in this layout; `ConfigError` if it cannot take it."""
        parallel = {k: v for k, v in dataclasses.asdict(self).items() if k != "remat"}
        return cfg.updated(model=dict(remat=self.remat), parallel=parallel)

    def overrides(self) -> str:
        """The command-line overrides that run this layout."""
        fields = dataclasses.asdict(self)
        return " ".join(f"--config.{'model' if k == 'remat' else 'parallel'}.{k}={v}" for k, v in fields.items())

    @classmethod
    def of(cls, cfg: RunConfig) -> Layout:
        p = cfg.parallel
        return cls(
            p.tensor, p.stage, p.fsdp, p.data, cfg.model.remat, p.microbatches, p.repeats, p.sequence_parallel,
            p.schedule,
        )


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: float  # bytes per device
    estimate: Estimate


def _schedules(stage: int, repeats: int) -> list[str]:
    """The schedules a pipeline of `stage` stages and `repeats` chunks a stage can run."""
    if stage == 1:
        return ["gpipe"]
    return list(CHUNKED_SCHEDULES) if repeats > 1 else list(CHUNKED_SCHEDULES.values())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg: RunConfig, gpus: int, per_node: int) -> Iterator[Layout]:
    """Every layout worth trying: tensor parallelism inside a node, pipeline stages on group
    boundaries, microbatches a power-of-two multiple of the stages."""
    groups, rows = cfg.model.groups, cfg.train.batch_size // cfg.train.grad_accum_steps
    for tensor in (t for t in _divisors(min(gpus, per_node)) if gpus % t == 0):
        for stage in (s for s in _divisors(groups) if (gpus // tensor) % s == 0):
            for fsdp in _divisors(gpus // (tensor * stage)):
                data = gpus // (tensor * stage * fsdp)
                per_replica = rows // (data * fsdp) if rows % (data * fsdp) == 0 else 0
                micro = [1] if stage == 1 else [stage * 2**k for k in range(8) if stage * 2**k <= per_replica]
                repeats = [1] if stage == 1 else [r for r in _divisors(groups // stage) if r <= 4]
                sequence_parallel = (False, True) if tensor > 1 else (False,)
                for remat, m, r, sp in itertools.product(REMATS, micro, repeats, sequence_parallel):
                    for schedule in _schedules(stage, r):
                        yield Layout(tensor, stage, fsdp, data, remat, m, r, sp, schedule)


class Searched(NamedTuple):
    fitting: list[Candidate]  # the layouts that pass the checks and fit, fastest first
    valid: int  # how many passed the checks
    refused: Counter[str]  # the checks' messages, each with how many layouts it refused


def search(
    cfg: RunConfig,
    gpus: int,
    accelerator: Accelerator,
    headroom: float = HEADROOM,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
) -> Searched:
    """Every layout of `gpus` devices, checked, planned and estimated."""
    fitting, valid, refused = [], 0, Counter()
    for layout in layouts(cfg, gpus, accelerator.per_node):
        try:
            candidate = layout.apply(cfg)
            validate(candidate, gpus)
        except ConfigError as e:
            refused[str(e)] += 1
            continue
        valid += 1
        total = memory(candidate)["total"]
        if total <= accelerator.memory * (1 - headroom):
            fitting.append(Candidate(layout, total, estimate(candidate, accelerator, efficiency)))
    fitting.sort(key=lambda c: (c.estimate.step, c.memory))  # equally fast: the smaller first
    return Searched(fitting, valid, refused)

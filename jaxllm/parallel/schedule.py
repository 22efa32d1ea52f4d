"""The pipeline schedule and the views it puts on layer groups and batches; what the model,
planner and checkpoints need to know of a pipeline, without its implementation.

Groups are stored canonically as [groups, ...], the same for every layout; a pipeline holds them in
the view [repeats, stages, groups_per_stage, ...] (group = (repeat·stages + stage)·groups_per_stage
+ g), a free reshape.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections


class Schedule(NamedTuple):
    stages: int
    repeats: int
    microbatches: int

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Fraction of stage-iterations that do no useful work."""
        return (self.stages - 1) / self.iterations


def schedule_of(cfg: ml_collections.ConfigDict) -> Schedule | None:
    """The pipeline schedule, or None when `parallel.stage` is 1."""
    p = cfg.parallel
    return Schedule(p.stage, p.repeats, p.microbatches) if p.stage > 1 else None


def pipeline_view(groups, schedule: Schedule):
    """[groups, ...] → [repeats, stages, groups_per_stage, ...]."""
    r, s = schedule.repeats, schedule.stages
    return jax.tree.map(lambda a: a.reshape(r, s, a.shape[0] // (r * s), *a.shape[1:]), groups)


def canonical_view(groups):
    """[repeats, stages, groups_per_stage, ...] → [groups, ...]."""
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), groups)


def split_microbatches(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] → [m, B/m, ...] taking every m-th row, so each device keeps its own rows."""
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)

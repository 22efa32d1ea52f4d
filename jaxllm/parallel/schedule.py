"""The views a pipeline schedule (`config.Schedule`) puts on layer groups and batches; what the
model, planner and checkpoints need to know of a pipeline, without its implementation.

Groups are stored canonically as [groups, ...], the same for every layout; a pipeline holds them in
the view [repeats, stages, groups_per_stage, ...] (group = (repeat·stages + stage)·groups_per_stage
+ g), a free reshape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config import Schedule


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

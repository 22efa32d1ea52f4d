"""Scan-based pipeline over layer stages: GPipe (repeats=1) and circular/interleaved (repeats>1).

The groups come in the pipeline view (see `schedule`), with `stages` on the `stage` mesh axis. One
`lax.scan` inside a `shard_map` manual over `stage` and `tensor` runs
repeats·microbatches + stages − 1 iterations; in each, every stage applies its groups to its current
microbatch and shifts the result to the next stage with a `ppermute`. Iteration k of stage s works
on microbatch (k − s) mod M of repeat (k − s) // M, so with M > S the last stage's output waits
M − S iterations in a small delay line before stage 0 takes it into the next repeat.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.parallel.collectives import all_reduce_sum, to_varying
from jaxllm.parallel.rules import RULES, constrain, manual_spec
from jaxllm.parallel.schedule import Schedule, split_microbatches

MANUAL_AXES = frozenset({"stage", "tensor"})  # the pipeline handles both by hand; data and fsdp stay automatic

# Inside the pipeline a stage's weights are whole on the FSDP dim (gathered once per step).
_GATHERED = {**RULES, "embed": None}


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def _merge(a: jax.Array) -> jax.Array:
    """Inverse of `split_microbatches`."""
    return jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:])


def pipeline_stack(groups, specs, x: jax.Array, ctx, schedule: Schedule, stack_fn):
    """Runs `stack_fn(stage_groups, x, ctx)` (a scan over one stage's groups) as a pipeline.

    `groups` are in the pipeline view, `specs` their ParamSpecs. They are gathered over `fsdp`
    once, before the loop, so the loop body never all-gathers weights; each iteration is
    rematerialised, so the backward pass stores only iteration inputs.
    """
    r, s, m = schedule.repeats, schedule.stages, schedule.microbatches
    delay = m - s if r > 1 else 0  # iterations the last stage's output waits for stage 0
    # [stages, repeats, groups_per_stage, ...], whole on `embed`: one FSDP gather per step.
    stage_major = jax.tree.map(
        lambda spec: (spec.axes[1], spec.axes[0], *spec.axes[2:]), specs, is_leaf=lambda x: hasattr(x, "axes")
    )
    weights = jax.tree.map(
        lambda a, axes: constrain(jnp.swapaxes(a, 0, 1), *axes, rules=_GATHERED), groups, stage_major
    )
    weight_specs = jax.tree.map(lambda axes: manual_spec(*axes, manual_axes=MANUAL_AXES), stage_major, is_leaf=_is_axes)
    micro = split_microbatches(x, m)
    ctx_micro = jax.tree.map(partial(split_microbatches, m=m), ctx)
    to_next_stage = [(j, (j + 1) % s) for j in range(s)]

    def one_stage(weights, micro, ctx_micro):
        """The loop as seen by one stage (the `stage` axis is manual here)."""
        stage = jax.lax.axis_index("stage")
        weights = jax.tree.map(lambda a: a[0], weights)
        micro = to_varying(micro, "stage")

        def iteration(carry, i):
            stage_in, waiting = carry
            work = i - stage  # repeat·M + microbatch of this stage's current work
            repeat, mb = jnp.clip(work // m, 0, r - 1), work % m
            out = stack_fn(
                jax.tree.map(lambda a: a[repeat], weights),
                stage_in,
                jax.tree.map(lambda a: a[mb], ctx_micro),
            )
            shifted = jax.lax.ppermute(out, "stage", to_next_stage)  # on stage 0: the last stage's output
            if delay:
                fed_back, waiting = waiting[i % delay], waiting.at[i % delay].set(shifted)
            else:
                fed_back = shifted
            nxt = i + 1
            first = jnp.where(nxt < m, micro[nxt % m], fed_back)
            return (jnp.where(stage == 0, first, shifted), waiting), shifted

        stage_in = jnp.where(stage == 0, micro[0], jnp.zeros_like(micro[0]))
        waiting = jax.lax.pcast(jnp.zeros((delay, *micro.shape[1:]), x.dtype), "stage", to="varying")
        body = jax.checkpoint(iteration, policy=jax.checkpoint_policies.nothing_saveable)
        _, finished = jax.lax.scan(body, (stage_in, waiting), jnp.arange(schedule.iterations))
        # Microbatch j leaves the last stage for good at iteration (repeats−1)·M + j + stages − 1;
        # stage 0 holds it, and shares it with every stage for the head and loss.
        out = finished[schedule.iterations - m :]
        return all_reduce_sum(jnp.where(stage == 0, out, jnp.zeros_like(out)), "stage")

    run = jax.shard_map(one_stage, in_specs=(weight_specs, P(), P()), out_specs=P(), axis_names=MANUAL_AXES)
    return _merge(run(weights, micro, ctx_micro))

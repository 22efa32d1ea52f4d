"""Scan-based pipeline over layer stages: GPipe (repeats=1) and circular/interleaved (repeats>1).

The groups come in the pipeline view (see `schedule`), with `stages` on the `stage` mesh axis. One
`lax.scan` inside a `shard_map` manual over every mesh axis runs repeats·microbatches + stages − 1
iterations; in each, every stage applies its groups to its current microbatch and shifts the result
to the next stage with a `ppermute`. Iteration k of stage s works on microbatch (k − s) mod M of
repeat (k − s) // M, so with M > S the last stage's output waits M − S iterations in a small delay
line before stage 0 takes it into the next repeat.

Weights, as Megatron keeps them: the loop reads compute-dtype (bf16) copies gathered over `fsdp`
once per step, while their gradients add up per device in fp32 across all iterations and are
reduced over the data-parallel devices once, in fp32, after the loop. (A scan sums a constant's
cotangent in that constant's dtype, so the bf16 copies pass no gradient; each use hands its
cotangent to an fp32 "sink" shaped like the copy instead. A projection weight reaches its op as a
`Copy`, copy and sink, and the op's weight-gradient dot writes its fp32 result to the sink, never
rounded to bf16 on the way; a norm's weight, kept in fp32, passes its cotangent to the sink.)
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.config import MESH_AXES, Schedule
from jaxllm.parallel.collectives import reduce_scatter_sum, to_varying, varying_axes
from jaxllm.parallel.rules import GATHERED_RULES, RULES, active_rules, as_tuple, constrain, is_axes, manual_spec
from jaxllm.parallel.schedule import split_microbatches
from jaxllm.parallel.tensor_parallel import RESIDUAL

MANUAL_AXES = frozenset(MESH_AXES)
BATCH_AXES = as_tuple(RULES["batch"])  # the data-parallel mesh axes


def stage_major_arrays(groups):
    """[repeats, stages, ...] → [stages, repeats, ...], the loop's order."""
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), groups)


def stage_major(specs):
    """Logical axes of each weight as the loop takes it: [stages, repeats, groups_per_stage, ...]."""
    return jax.tree.map(lambda s: (s.axes[1], s.axes[0], *s.axes[2:]), specs, is_leaf=lambda x: hasattr(x, "axes"))


def gather_stage_weights(groups, specs, dtype) -> dict:
    """The copies the loop computes with: stage-major, cast to `dtype` (parameters whose spec keeps
    them in fp32, norm and int8 scales, stay fp32; int8 weights stay int8) and gathered over
    `fsdp`. Built once per step; with gradient accumulation, the step passes them to every
    microstep's pipeline."""

    def one(a, spec, axes):
        keep = spec.keep_fp32 or not jnp.issubdtype(a.dtype, jnp.floating)
        return constrain(a if keep else a.astype(dtype), *axes, rules=GATHERED_RULES)

    copies = jax.tree.map(one, stage_major_arrays(groups), specs, stage_major(specs))
    return jax.lax.stop_gradient(copies)


def varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` marked per-device along every manual axis that `like` varies over."""
    missing = tuple(varying_axes(like) - varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _grad_sink(shard: jax.Array, copy: jax.Array, spec: P) -> jax.Array:
    """fp32 zeros shaped like `copy` (this device's gathered weight); the gradient they receive is
    summed over the data-parallel devices and lands on `shard` (this device's fp32 parameter)."""
    return varying_like(jnp.zeros(copy.shape, jnp.float32), copy)


def _grad_sink_fwd(shard, copy, spec):
    return _grad_sink(shard, copy, spec), None


def _grad_sink_bwd(spec, _, grad):
    return reduced_grad(grad, spec), None


def reduced_grad(grad: jax.Array, spec: P) -> jax.Array:
    """A device's fp32 gradient of a parameter sharded as `spec` (without its stage dim), summed
    over the devices: one reduce-scatter over the data-parallel axes that split the parameter, one
    sum over the other axes the gradient varies over but the parameter does not (the other
    data-parallel axes; `tensor` for a replicated weight applied to a sequence split over it)."""
    split = {axis: dim for dim, axes in enumerate(spec) for axis in as_tuple(axes) if axis in BATCH_AXES}
    for axis, dim in split.items():
        grad = reduce_scatter_sum(grad, axis, dim)
    held = {axis for axes in spec for axis in as_tuple(axes)} | {"stage"}
    if rest := tuple(sorted(varying_axes(grad) - held)):
        grad = jax.lax.psum(grad, rest)
    return grad


_grad_sink.defvjp(_grad_sink_fwd, _grad_sink_bwd)


class Copy(NamedTuple):
    """A projection weight as the loop's projections take it: `values`, the compute-dtype copy,
    and `sink`, where the projection op (`jaxllm.model.project`) puts its fp32 gradient."""

    values: jax.Array
    sink: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self):
        return self.values.dtype


@jax.custom_vjp
def _with_fp32_grad(copy: jax.Array, sink: jax.Array) -> jax.Array:
    """`copy`, whose cotangent goes to `sink` in fp32."""
    return copy


def _with_fp32_grad_fwd(copy, sink):
    return copy, None


def _with_fp32_grad_bwd(_, grad):
    return None, grad.astype(jnp.float32)


_with_fp32_grad.defvjp(_with_fp32_grad_fwd, _with_fp32_grad_bwd)


def loop_weight(copy: jax.Array, sink: jax.Array, spec) -> Copy | jax.Array:
    """What the loop computes with: a projection's weight as a `Copy`, any other (a norm's, kept in
    fp32) as its copy passing its cotangent to the sink."""
    return Copy(copy, sink) if spec.quantizable else _with_fp32_grad(copy, sink)


def merge_microbatches(a: jax.Array) -> jax.Array:
    """Inverse of `split_microbatches`."""
    return jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:])


def pipeline_stack(groups, specs, x: jax.Array, ctx, schedule: Schedule, stack_fn, copies):
    """Runs `stack_fn(stage_groups, x, ctx)` (a scan over one stage's groups) as a pipeline.

    `groups` are the fp32 parameters in the pipeline view, `specs` their ParamSpecs, `copies` the
    `gather_stage_weights` of them. Each iteration is rematerialised, so the backward pass stores
    only iteration inputs. The output leaves the loop with its sequence split over `stage`, so the
    head and loss after it run once, not on every stage.
    """
    r, s, m = schedule.repeats, schedule.stages, schedule.microbatches
    delay = m - s if r > 1 else 0  # iterations the last stage's output waits for stage 0
    axes = stage_major(specs)
    spec_of = partial(manual_spec, manual_axes=MANUAL_AXES)
    shard_specs = jax.tree.map(lambda a: spec_of(*a), axes, is_leaf=is_axes)
    copy_specs = jax.tree.map(lambda a: spec_of(*a, rules=GATHERED_RULES), axes, is_leaf=is_axes)
    micro_spec = spec_of(None, *RESIDUAL, rules=active_rules())  # [M, mb, seq, embed]; seq on `tensor` with SP
    out_spec = P(None, micro_spec[1], (*as_tuple(micro_spec[2]), "stage"))
    micro = split_microbatches(x, m)
    ctx_micro = jax.tree.map(partial(split_microbatches, m=m), ctx._replace(dropout=None))
    to_next_stage = [(j, (j + 1) % s) for j in range(s)]

    def one_stage(shards, copies, micro, ctx_micro, dropout):
        """The loop as seen by one device."""
        stage = jax.lax.axis_index("stage")
        micro = to_varying(micro, "stage")
        copies = jax.tree.map(lambda c: varying_like(c[0], micro), copies)
        sinks = jax.tree.map(
            lambda w, c, spec: _grad_sink(w[0], c, P(*spec[1:])), shards, copies, shard_specs, is_leaf=is_axes
        )

        def iteration(carry, i):
            stage_in, waiting = carry
            work = i - stage  # repeat·M + microbatch of this stage's current work
            repeat, mb = jnp.clip(work // m, 0, r - 1), work % m
            weights = jax.tree.map(
                lambda c, sink, spec: loop_weight(c[repeat], sink[repeat], spec), copies, sinks, specs
            )
            # Each stage, repeat and microbatch (`work`) draws its own LoRA dropout masks.
            stage_ctx = jax.tree.map(lambda a: a[mb], ctx_micro)._replace(dropout=dropout)
            out = stack_fn(weights, stage_in, stage_ctx.folded(stage).folded(work))
            shifted = jax.lax.ppermute(out, "stage", to_next_stage)  # on stage 0: the last stage's output
            if delay:
                fed_back, waiting = waiting[i % delay], waiting.at[i % delay].set(shifted)
            else:
                fed_back = shifted
            nxt = i + 1
            first = jnp.where(nxt < m, micro[nxt % m], fed_back)
            return (jnp.where(stage == 0, first, shifted), waiting), shifted

        stage_in = jnp.where(stage == 0, micro[0], jnp.zeros_like(micro[0]))
        waiting = varying_like(jnp.zeros((delay, *micro.shape[1:]), x.dtype), stage_in)
        body = jax.checkpoint(iteration, policy=jax.checkpoint_policies.nothing_saveable)
        _, finished = jax.lax.scan(body, (stage_in, waiting), jnp.arange(schedule.iterations))
        # Microbatch j leaves the last stage for good at iteration (repeats−1)·M + j + stages − 1;
        # stage 0 holds it, and each stage takes a 1/stages slice of its sequence for the head.
        out = finished[schedule.iterations - m :]
        return reduce_scatter_sum(jnp.where(stage == 0, out, jnp.zeros_like(out)), "stage", 2)

    run = jax.shard_map(
        one_stage,
        in_specs=(shard_specs, copy_specs, micro_spec, P(None, micro_spec[1]), P()),
        out_specs=out_spec,
        axis_names=MANUAL_AXES,
    )
    return merge_microbatches(run(stage_major_arrays(groups), copies, micro, ctx_micro, ctx.dropout))

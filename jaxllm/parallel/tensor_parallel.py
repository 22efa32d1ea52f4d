"""Megatron-style tensor parallelism: a block runs on each `tensor` shard of its weights (QKV, gate,
up column-parallel; out, down row-parallel) and ends in one all-reduce. Model code names only
logical axes; this module alone knows they map to the `tensor` mesh axis."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.parallel.collectives import all_gather, all_reduce_sum, reduce_scatter_sum, to_varying, varying_over
from jaxllm.parallel.rules import active_rules, as_tuple, is_axes, manual_spec, sequence_parallel

RESIDUAL = ("batch", "act_seq", "act_embed")  # logical axes of a block's input and output
TENSOR = frozenset({"tensor"})


def tensor_parallel(fn: Callable, *arg_axes: Any, kept_axes: tuple = (), split_batch: bool = True) -> Callable:
    """`fn(x, *args)` on this device's `tensor` shard, its partial outputs all-reduced; with
    sequence parallelism, `x` comes split along the sequence and is all-gathered first, and the
    outputs are reduce-scattered back along it (the same bytes as one all-reduce).

    `x` is the residual stream ([batch, seq, embed]); `arg_axes` gives, per further argument, the
    logical axis names of each array (a pytree of tuples; `()` for a replicated argument). With
    `kept_axes`, `fn` returns (output, *kept): only the output is summed, each kept array stays
    on its shard and is named by its entry (a KV cache's pools stay split by kv heads). A region
    whose rows share state (a paged KV cache's pool) keeps them whole with `split_batch=False`. Built
    per trace, as shard_map binds the mesh in context at its first call. Inside a region already
    manual over `tensor` (the pipeline) it needs no shard_map; without a mesh or without tensor
    parallelism `fn` runs as is.
    """
    split = sequence_parallel()

    def sum_output(y):
        if split:
            return reduce_scatter_sum(y, "tensor", 1)
        return all_reduce_sum(y, "tensor")

    def summed(x, *args):
        out = fn(all_gather(x, "tensor", 1) if split else to_varying(x, "tensor"), *args)
        return (sum_output(out[0]), *out[1:]) if kept_axes else sum_output(out)

    mesh = jax.sharding.get_abstract_mesh()
    if "tensor" in mesh.manual_axes:
        return summed
    if mesh.shape.get("tensor", 1) == 1:
        return fn
    # The region is manual over the batch's mesh axes too (where they split the rows evenly):
    # before a sequence-parallel collective over `tensor` in a region where the batch is still
    # automatic, XLA gathers the whole batch onto every device; and the weights' gradients leave
    # it summed over all data-parallel devices at once.
    rules = active_rules()

    def call(x, *args):
        batch = tuple(a for a in as_tuple(rules["batch"]) if mesh.shape[a] > 1 and split_batch)
        batch = batch if x.shape[0] % math.prod(mesh.shape[a] for a in batch) == 0 else ()
        by_hand = TENSOR | frozenset(batch)

        def spec(axes):
            """Arrays that carry the batch split by hand over `by_hand`; weights over `tensor` only
            (the compiler gathers their FSDP shards at the boundary, as for any weight)."""
            return manual_spec(*axes, manual_axes=by_hand if "batch" in axes else TENSOR, rules=rules)

        def region(x, *args):
            """Weights turn per-device over the batch axes as they enter, in their stored dtype:
            their gradients are summed over those axes here, in fp32, not after a cast to bf16."""

            def enter(axes, a):
                return a if "batch" in axes else jax.tree.map(lambda w: varying_over(w, batch), a)

            args = (jax.tree.map(enter, axes, a, is_leaf=is_axes) for axes, a in zip(arg_axes, args, strict=True))
            return summed(x, *args)

        in_specs = (spec(RESIDUAL), *(jax.tree.map(spec, a, is_leaf=is_axes) for a in arg_axes))
        out_specs = (spec(RESIDUAL), *map(spec, kept_axes)) if kept_axes else spec(RESIDUAL)
        return jax.shard_map(region, in_specs=in_specs, out_specs=out_specs, axis_names=by_hand)(x, *args)

    return call


def vocab_split_summed_loss(
    logits: jax.Array, targets: jax.Array, mask: jax.Array, vocab_size: int, masked: float, axes: tuple[str, ...]
) -> jax.Array:
    """Next-token cross-entropy of `targets` summed over the tokens `mask` weighs, inside a region
    manual over the mesh `axes` whose `logits` [batch, seq, block] are this device's block of the
    padded vocabulary (blocks in the order of `axes`, major first), entries past `vocab_size` set
    to `masked` (Megatron's vocab-parallel cross-entropy): the softmax's max and sum and each
    target's logit are reduced over `axes`, so no device holds a row of logits whole."""
    width = logits.shape[-1]
    start = jax.lax.axis_index(axes) * width
    logits = jnp.where(start + jnp.arange(width) < vocab_size, logits, masked)
    top = jax.lax.stop_gradient(jax.lax.pmax(jax.lax.stop_gradient(logits).max(axis=-1), axes))
    lse = top + jnp.log(jax.lax.psum(jnp.exp(logits - top[..., None]).sum(axis=-1), axes))
    local, inside = _in_block(targets, width, axes)
    picked = jnp.take_along_axis(logits, local[..., None], axis=-1)[..., 0]
    target_logit = jax.lax.psum(jnp.where(inside, picked, 0.0), axes)
    return jnp.sum((lse - target_logit) * mask.astype(jnp.float32))


def _in_block(ids: jax.Array, width: int, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """Each id's index in this device's block of `width` entries of a vocabulary split over `axes`
    (clipped into the block), and whether the block holds it."""
    local = ids - (jax.lax.axis_index(axes) * width if axes else 0)
    return jnp.clip(local, 0, width - 1), (local >= 0) & (local < width)


def vocab_split_lookup(block: jax.Array, tokens: jax.Array, axes: tuple[str, ...], seq_axes: tuple[str, ...]):
    """The rows of `tokens` [mb, seq] from a table split over `axes` along its vocabulary (Megatron's
    vocab-parallel embedding): each device looks up those its `block` holds, in the block's dtype
    (one device holds each row), summed over the blocks; under sequence parallelism (`seq_axes`,
    the same axes) each device keeps its piece of the sequence."""
    local, inside = _in_block(tokens, block.shape[0], axes)
    rows = jnp.where(inside[..., None], block[local], 0)
    if seq_axes:
        return reduce_scatter_sum(rows, axes, 1)
    return all_reduce_sum(rows, axes) if axes else rows


def vocab_split_lookup_grad(grads: jax.Array, tokens: jax.Array, dx: jax.Array, axes, seq_axes) -> jax.Array:
    """`grads`, this device's block of the table's fp32 gradient sum, with `vocab_split_lookup`'s
    gradient added: `dx` [mb, seq (or its piece), embed] into the rows of `tokens` the block holds."""
    dx = all_gather(dx, seq_axes, 1) if seq_axes else dx
    local, inside = _in_block(tokens, grads.shape[0], axes)
    return grads.at[local].add(jnp.where(inside[..., None], dx.astype(jnp.float32), 0))

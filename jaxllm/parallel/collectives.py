"""Collectives used inside `shard_map` regions.

XLA's CPU backend (jax 0.10) aborts compiling bf16 all-reduces inside shard_map ("Invalid binary
instruction opcode copy"), so on CPU the reductions below, and the ones JAX derives for their
gradients, run in fp32. Accelerators reduce in the input's dtype, as Megatron does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _reduce_in_fp32(x: jax.Array) -> bool:
    return x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu"


def all_reduce_sum(x: jax.Array, axis: str) -> jax.Array:
    """`psum` over a manual mesh axis."""
    if _reduce_in_fp32(x):
        return jax.lax.psum(x.astype(jnp.float32), axis).astype(x.dtype)
    return jax.lax.psum(x, axis)


def reduce_scatter_sum(x: jax.Array, axis: str, dim: int) -> jax.Array:
    """`psum_scatter` over a manual mesh axis, each device keeping its block of `dim`."""
    if _reduce_in_fp32(x):
        return jax.lax.psum_scatter(x.astype(jnp.float32), axis, scatter_dimension=dim, tiled=True).astype(x.dtype)
    return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def all_gather(x: jax.Array, axis: str, dim: int) -> jax.Array:
    """Tiled `all_gather` over a manual mesh axis along `dim` (its gradient is a `reduce_scatter_sum`)."""
    if _reduce_in_fp32(x):
        return jax.lax.all_gather(x.astype(jnp.float32), axis, axis=dim, tiled=True).astype(x.dtype)
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes along which `x` may differ between devices."""
    return jax.typeof(x).manual_axis_type.varying


def whole_tensor_max(local: jax.Array, part: jax.Array) -> jax.Array:
    """`local`, a max over this device's `part` of a tensor, maxed over the devices holding its other
    parts: the manual axes `part` varies over, except `stage`, whose devices hold other layers and
    other microbatches."""
    axes = tuple(sorted(varying_axes(part) - {"stage"}))
    return jax.lax.pmax(local, axes) if axes else local


def varying_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`x` marked per-device along each of the manual `axes` it does not vary over yet; the
    backward pass sums its cotangent over them here, in x's dtype."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def to_varying(x: jax.Array, axis: str) -> jax.Array:
    """Marks a replicated value as per-device along `axis`; the backward pass all-reduces its
    cotangent once here, instead of once per use."""
    if _reduce_in_fp32(x):
        return jax.lax.pcast(x.astype(jnp.float32), axis, to="varying").astype(x.dtype)
    return jax.lax.pcast(x, axis, to="varying")

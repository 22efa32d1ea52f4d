"""FP8 dense projections with per-tensor current scaling (DESIGN §4).

Forward operands are e4m3, output gradients e5m2, each scaled by its own amax as computed in this
step: no scale state, so the pipeline, gradient accumulation, a shared QKV applied by several
layers, the NaN skip and checkpoints need nothing new. One call projects an input by several
weights (q|k|v, gate|up) and quantizes that input once.

Scales are powers of two, so the dequantized operands (fp8 value × scale) are exact in any wider
float: the dot of dequantized operands in the compute dtype (fp32 accumulation) is what XLA's GPU
backend fuses into one cuBLASLt FP8 GEMM taking the scales, and what the CPU executes exactly as
an emulation. Forward dots leave cuBLASLt its fast accumulation (DEFAULT precision); gradient dots
ask for full precision (HIGHEST).

An amax is the whole tensor's: sharded operands reduce through the compiler, and inside
`shard_map` through `collectives.whole_tensor_max`, so every layout gets the same scales (a
replicated input typed as per-device costs one redundant scalar all-reduce).
`amax_reduce="local"` skips that reduction.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.parallel.collectives import whole_tensor_max

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


class Scaled(NamedTuple):
    """`values` (fp8) × `scale` (an fp32 power of two) approximates the quantized tensor."""

    values: jax.Array
    scale: jax.Array

    def dequantized(self, dtype) -> jax.Array:
        return self.values.astype(dtype) * self.scale.astype(dtype)


def amax(x: jax.Array, reduce: bool) -> jax.Array:
    """max |x| over the whole tensor (see the module doc), in fp32."""
    local = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return whole_tensor_max(local, x) if reduce else local


def quantize(x: jax.Array, dtype, reduce: bool) -> Scaled:
    """`x` in fp8 `dtype`, scaled by the power of two just above amax / (the format's largest
    value): that ratio's exponent field plus one, so amax / scale is in range and dividing by the
    scale is exact. A NaN or inf in `x` makes the result non-finite, for the train step's check."""
    ratio = amax(x, reduce) / float(jnp.finfo(dtype).max)
    exponent = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(ratio, jnp.int32), 23)
    scale = jax.lax.bitcast_convert_type(jax.lax.shift_left(exponent + 1, 23), jnp.float32)
    return Scaled((x.astype(jnp.float32) / scale).astype(dtype), scale)


def _dot(spec: str, a: Scaled, b: Scaled, dtype, precision) -> jax.Array:
    return jnp.einsum(spec, a.dequantized(dtype), b.dequantized(dtype), precision=precision)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _projections(x: jax.Array, weights: tuple[jax.Array, ...], spec: str, reduce: bool) -> tuple[jax.Array, ...]:
    return _forward(x, weights, spec, reduce)[0]


def _forward(x, weights, spec, reduce):
    qx = quantize(x, E4M3, reduce)
    qws = tuple(quantize(w, E4M3, reduce) for w in weights)
    outs = tuple(_dot(spec, qx, qw, x.dtype, jax.lax.Precision.DEFAULT) for qw in qws)
    return outs, (qx, qws)  # the backward pass reads the fp8 operands: 1 byte per element


def _backward(spec, reduce, residuals, grads):
    """dx = Σ g·wᵀ and dw = xᵀ·g, with each output gradient g quantized once to e5m2."""
    (qx, qws), dtype = residuals, grads[0].dtype
    (x_dims, w_dims), y_dims = spec.split("->")[0].split(","), spec.split("->")[1]
    dx, dws = None, []
    for qw, g in zip(qws, grads, strict=True):
        qg = quantize(g, E5M2, reduce)
        term = _dot(f"{y_dims},{w_dims}->{x_dims}", qg, qw, dtype, jax.lax.Precision.HIGHEST)
        dx = term if dx is None else dx + term
        dws.append(_dot(f"{x_dims},{y_dims}->{w_dims}", qx, qg, dtype, jax.lax.Precision.HIGHEST))
    return dx, tuple(dws)


_projections.defvjp(_forward, _backward)


def fp8_projections(amax_reduce: str):
    """The FP8 projection op; weights are first cast to the input's (compute) dtype, as the
    compute-dtype op does."""
    reduce = amax_reduce == "global"

    def project(x: jax.Array, weights: tuple[jax.Array, ...], spec: str) -> tuple[jax.Array, ...]:
        return _projections(x, tuple(w.astype(x.dtype) for w in weights), spec, reduce)

    return project

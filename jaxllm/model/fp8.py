"""FP8 dense projections with per-tensor current scaling (DESIGN §4).

Forward operands are e4m3, output gradients e5m2, each scaled by its own amax as computed in this
step: no scale state, so the pipeline, gradient accumulation, a shared QKV applied by several
layers, the NaN skip and checkpoints need nothing new. One call projects an input by several
weights (q|k|v, gate|up) and quantizes that input once.

Scales are powers of two, so the dequantized operands (fp8 value × scale) are exact in any wider
float: the dot of dequantized operands in the compute dtype (fp32 accumulation) is what XLA's GPU
backend fuses into one cuBLASLt FP8 GEMM taking the scales, and what the CPU executes exactly as
an emulation. Forward dots leave cuBLASLt its fast accumulation (DEFAULT precision); gradient dots
ask for full precision (HIGHEST), and the weight gradient's comes back in fp32 (`project.py`).

An amax is the whole tensor's: sharded operands reduce through the compiler, and inside
`shard_map` through `collectives.whole_tensor_max`, so every layout gets the same scales (a
replicated input typed as per-device costs one redundant scalar all-reduce).
`amax_reduce="local"` skips that reduction.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.model.project import projections
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


class Fp8(NamedTuple):
    """The FP8 encoding of `project.projections`: the input and weights in e4m3, each output
    gradient in e5m2, quantized once per call; forward dots at DEFAULT precision (cuBLASLt's fast
    accumulation), gradient dots at HIGHEST."""

    reduce: bool
    forward_precision: jax.lax.Precision = jax.lax.Precision.DEFAULT
    grad_precision: jax.lax.Precision = jax.lax.Precision.HIGHEST

    def input(self, x: jax.Array) -> Scaled:
        return quantize(x, E4M3, self.reduce)

    weight = input

    def grad(self, g: jax.Array) -> Scaled:
        return quantize(g, E5M2, self.reduce)


def fp8_projections(amax_reduce: str):
    """The FP8 projection op (weights cast to the input's compute dtype inside it, as the plain op
    does; their gradients come back in fp32)."""
    return projections(Fp8(amax_reduce == "global"))

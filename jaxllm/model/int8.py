"""INT8 weights: each dense projection's weight is stored as int8 `q` with symmetric
per-output-channel scales, `scale = max|W| over the contracted axes / 127`, and applied as
`einsum(x, q) * scale` (the int8 values are exact in any float dtype). Serving holds its weights
this way (`--quantize int8`), and LoRA fine-tuning may hold its frozen base this way
(`model.quantize="int8"` with `model.lora.rank` > 0): the adapters then train through the int8 base.

A quantized weight keeps its key in the params tree and holds `{"q": int8, "scale": fp32}`; the
scale's logical axes are the weight's minus the contracted ones, so the rules table shards it
with no entry of its own: a column-parallel scale is split with its output channels, a
row-parallel one is replicated and commutes with the tensor-parallel sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.model.params import declare, is_spec

INT8_MAX = 127


def int8_model(model: ModelConfig) -> ModelConfig:
    """A copy of the model settings with int8 projection weights."""
    return model.replace(quantize="int8")


class Int8Weight(nnx.Module):
    """The int8 form of a weight of `shape` whose dims `contracted` a projection sums over."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str | None, ...], contracted: Sequence[int]):
        kept = [i for i in range(len(shape)) if i not in contracted]
        self.q = declare(shape, axes, jnp.int8, "zeros", own_dtype=True)
        self.scale = declare(tuple(shape[i] for i in kept), tuple(axes[i] for i in kept), jnp.float32, "ones",
                             own_dtype=True, keep_fp32=True)  # fmt: skip


def symmetric_int8(x: jax.Array, axes: Sequence[int], keepdims: bool = False) -> tuple[jax.Array, jax.Array]:
    """(q, scale): `x` ≈ q × scale with one fp32 scale per slice over `axes`, `max|x| / 127` (0 for
    an all-zero slice)."""
    x, axes = x.astype(jnp.float32), tuple(axes)
    scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / INT8_MAX
    q = jnp.clip(jnp.round(x / jnp.where(scale > 0, scale, 1.0)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale if keepdims else jnp.squeeze(scale, axes)


def quantize_weight(w: jax.Array, contracted: Sequence[int]) -> dict[str, jax.Array]:
    """{"q", "scale"} of `w` with one scale per output channel."""
    q, scale = symmetric_int8(w, contracted)
    return {"q": q, "scale": scale}


def contracted_dims(spec: dict) -> list[int]:
    """The dims a projection sums over, of an int8 weight's specs ({"q", "scale"}): those the
    scale lacks."""
    return [i for i, axis in enumerate(spec["q"].axes) if axis not in spec["scale"].axes]


def quantize_tree(params: dict, full_specs: dict, int8_specs: dict) -> dict:
    """`params` (of the model with `full_specs`) with each quantizable weight in int8, as the same
    model with `int8_specs` holds it; one already in int8 is kept, the rest are left as they are."""

    def convert(spec, quantized, w):
        if not spec.quantizable or isinstance(w, dict):
            return w
        return quantize_weight(w, contracted_dims(quantized))

    return jax.tree.map(convert, full_specs, int8_specs, params, is_leaf=is_spec)


def dequantize(w: dict, contracted: Sequence[int]) -> jax.Array:
    """The fp32 weight an int8 one ({"q", "scale"}) stands for, q × scale."""
    return w["q"].astype(jnp.float32) * jnp.expand_dims(w["scale"], tuple(contracted))


def int8_projections(x: jax.Array, weights: tuple[dict, ...], spec: str) -> tuple[jax.Array, ...]:
    """`project` for int8 weights: each einsum in x's dtype with fp32 results, times the scale
    (the output's trailing dims are the weight's output channels), back in x's dtype."""
    return tuple(
        (jnp.einsum(spec, x, w["q"].astype(x.dtype), preferred_element_type=jnp.float32) * w["scale"]).astype(x.dtype)
        for w in weights
    )

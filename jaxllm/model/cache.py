"""The KV cache of a decoder generating for `slots` sequences at once. Layers of a group share
their QKV weights but apply them to different inputs, so each layer has its own keys and values:
[groups, qkv_share_every, slots, kv_heads, max_len, head_dim] each (kv heads before positions,
so attention's matmuls read a layer's slice without transposing it). The decoder carries the cache
through its scan over the layers and writes only the new positions, so a caller that donates it
updates it in place.

An int8 cache (`Int8`) holds each token's key (and value) per head as int8 with one fp32 scale,
`max|k| / 127` over head_dim: half a bf16 cache's bytes plus 4 per token and head. Entries are
quantized as they are written; attention applies the scales to its scores and probabilities, so
no dequantized copy of the cache is ever made."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.model.int8 import symmetric_int8

AXES = ("layers", "sublayers", "batch", "kv_heads", None, "head_dim")  # logical axes of keys and values
LAYER_AXES = AXES[2:]  # one layer's: [slots, kv_heads, max_len, head_dim]


class Int8(NamedTuple):
    """int8 entries [..., head_dim] and their scales [..., 1]: entry ≈ q × scale."""

    q: jax.Array
    scale: jax.Array


Entries = jax.Array | Int8


def encode(new: jax.Array, like: Entries) -> Entries:
    """New keys or values [..., head_dim] in the form of the cache `like`."""
    if isinstance(like, Int8):
        return Int8(*symmetric_int8(new, (-1,), keepdims=True))
    return new.astype(like.dtype)


class KVCache(NamedTuple):
    keys: Entries
    values: Entries

    @classmethod
    def empty(cls, model: ModelConfig, slots: int, max_len: int, dtype=None) -> KVCache:
        """Zeros in `dtype` (default: the model's compute dtype; 'int8': `Int8` entries)."""
        s = model
        shape = (s.groups, model.qkv_share_every, slots, s.num_kv_heads, max_len, s.head_dim)

        def zeros() -> Entries:
            if jnp.dtype(dtype or model.dtype) == jnp.int8:
                return Int8(jnp.zeros(shape, jnp.int8), jnp.zeros((*shape[:-1], 1), jnp.float32))
            return jnp.zeros(shape, dtype or model.dtype)

        return cls(zeros(), zeros())

    @property
    def max_len(self) -> int:
        return jax.tree.leaves(self.keys)[0].shape[4]

    def layer(self, group: jax.Array, index: int) -> tuple[Entries, Entries]:
        """One layer's keys and values: [slots, kv_heads, max_len, head_dim] each."""
        return jax.tree.map(lambda a: a[group, index], (self.keys, self.values))

    def store(self, group: jax.Array, index: int, keys: Entries, values: Entries, positions: jax.Array):
        """The cache with one layer's new keys and values [slots, t, kv_heads, head_dim] written at
        `positions` [slots, t] (consecutive per row): a scatter of those entries alone, batched over the
        slots so each row is written where it lives, never a rewrite of the layer's slice."""
        starts = positions[:, :1]
        where = jnp.concatenate([jnp.full_like(starts, group), jnp.full_like(starts, index), starts], axis=1)
        dims = jax.lax.ScatterDimensionNumbers(
            update_window_dims=(1, 2, 3),  # [kv_heads, t, head_dim] of each slot's update
            inserted_window_dims=(0, 1),  # group, layer
            scatter_dims_to_operand_dims=(0, 1, 4),  # (group, layer, position)
            operand_batching_dims=(2,),  # slots
            scatter_indices_batching_dims=(0,),
        )

        def write(cache, new):
            new = new.swapaxes(1, 2).astype(cache.dtype)  # [slots, kv_heads, t, head_dim]
            return jax.lax.scatter(cache, where, new, dims, indices_are_sorted=True)

        return KVCache(*jax.tree.map(write, (self.keys, self.values), (keys, values)))

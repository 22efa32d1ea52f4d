"""The KV cache as pages: one pool of fixed-size pages per layer for keys and one for values,
[layers, pages, kv_heads, page_size, head_dim] each (a page holds its positions for every kv head
side by side, so reading a page is one contiguous copy; kv heads split over `tensor`), and a page
table [batch, pages per sequence] saying which pages hold each sequence's positions, in
order: position p of row b lives at page `table[b, p // page_size]`, offset `p % page_size`.
Layers of a group share their QKV weights but apply them to different inputs, so each layer has
its own keys and values.

A serving engine keeps one pool for all its sequences and hands each step the table of the rows
it runs; `KVCache.empty` is the contiguous special case, one page of `max_len` per
row. New entries are scattered into the pool where their pages say and attention gathers only the
pages the table names, so a step's cost follows the table's width, never the pool's size. A
position of -1 (a padding token) writes to page 0, which a paged pool keeps as scratch.

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

AXES = (None, None, "kv_heads", None, "head_dim")  # logical axes of a pool of keys or values
SCRATCH_PAGE = 0  # where padding tokens write; a paged pool never hands it to a sequence


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


def _pool(model: ModelConfig, pages: int, page_size: int, dtype) -> Entries:
    shape = (model.num_layers, pages, model.num_kv_heads, page_size, model.head_dim)
    if jnp.dtype(dtype or model.dtype) == jnp.int8:
        return Int8(jnp.zeros(shape, jnp.int8), jnp.zeros((*shape[:-1], 1), jnp.float32))
    return jnp.zeros(shape, dtype or model.dtype)


class KVCache(NamedTuple):
    keys: Entries  # [layers, pages, kv_heads, page_size, head_dim]
    values: Entries
    table: jax.Array  # [batch, pages per sequence] int32

    @classmethod
    def empty(cls, model: ModelConfig, slots: int, max_len: int, dtype=None) -> KVCache:
        """Zeros for `slots` rows of `max_len` positions, one page per row, in `dtype` (default:
        the model's compute dtype; 'int8': `Int8` entries)."""
        table = jnp.arange(slots, dtype=jnp.int32)[:, None]
        return cls(_pool(model, slots, max_len, dtype), _pool(model, slots, max_len, dtype), table)

    @classmethod
    def paged(cls, model: ModelConfig, pages: int, page_size: int, dtype=None) -> KVCache:
        """A pool of `pages` pages of `page_size` positions (page 0 the scratch page), with an
        empty table: each step gets its rows' table."""
        empty = jnp.zeros((0, 1), jnp.int32)
        return cls(_pool(model, pages, page_size, dtype), _pool(model, pages, page_size, dtype), empty)


def locate(table: jax.Array, positions: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) of each of `positions` [b, t] in the pages `table` [b, P] names; -1: the
    scratch page."""
    at = jnp.take_along_axis(table, jnp.maximum(positions, 0) // page_size, axis=1, mode="clip")
    return jnp.where(positions >= 0, at, SCRATCH_PAGE), positions % page_size


def write(pool: Entries, new: Entries, layer: jax.Array, table: jax.Array, positions: jax.Array) -> Entries:
    """`pool` with `new` [b, t, kv_heads, d] written at `positions` [b, t] of each row's pages
    (-1: the scratch page): a scatter of those entries alone, in place when the pool is donated."""
    page, offset = locate(table, positions, jax.tree.leaves(pool)[0].shape[3])
    return jax.tree.map(lambda p, n: p.at[layer, page, :, offset].set(n.astype(p.dtype)), pool, new)


def read(pool: Entries, layer: jax.Array, table: jax.Array) -> Entries:
    """One layer's pages named by `table` [b, P], as each row's positions in order: [b, kv_heads,
    P × page_size, d] (a gather of those pages alone)."""

    def rows(p):
        pages = p[layer, table]  # [b, P, kv_heads, page_size, d]: one gather, no copy of the layer
        b, width, kv_heads, page_size, d = pages.shape
        return pages.swapaxes(1, 2).reshape(b, kv_heads, width * page_size, d)

    return jax.tree.map(rows, pool)

"""The serving engine's device steps over a paged KV cache (see `model.cache`).

`prefill` reads a chunk of up to T tokens for each of B rows (a prompt whole, or a piece of a
long one) into the pages each row's table names, attending to what those pages already hold;
a row whose chunk ends its prompt samples its first token. `decode` advances B decoding rows by
one token each. Both take each row's slot, a row of `Slots`: the token it feeds next and its
sampling settings stay on the device, so one decode step can be dispatched before the host has
read the last one's tokens. B, T and the table's width come in a few bucket sizes (`Buckets`),
each compiled when the engine starts; padding rows use the scratch slot, position -1 and the
scratch page. A row's tokens depend only on its request (see `sampling`), never on its neighbours.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.model.cache import KVCache
from jaxllm.model.decoder import Model
from jaxllm.model.sampling import Sampling, sample

TOP_LOGPROBS = 20
MIN_WIDTH = 256  # tokens the narrowest table covers: reading fewer saves little next to the weights


def _doubling(start: int, top: int) -> list[int]:
    sizes = [start]
    while sizes[-1] * 2 < top:
        sizes.append(sizes[-1] * 2)
    return sorted({*(s for s in sizes if s < top), top})


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The shapes the engine compiles: decode batches of `rows` (powers of two up to the slots);
    tables of `pages` pages (a doubling from `MIN_WIDTH` tokens up to `serve.max_len`); prefill
    chunks of `chunks` tokens (a doubling from 16 up to `serve.prefill_chunk`), each in the row
    buckets that fit the token budget."""

    rows: list[int]
    pages: list[int]
    chunks: list[int]
    budget: int  # prefill tokens per step

    @classmethod
    def of(cls, slots: int, max_len: int, page_size: int, prefill_chunk: int) -> Buckets:
        max_pages = -(-max_len // page_size)
        pages = _doubling(min(max_pages, max(1, MIN_WIDTH // page_size)), max_pages)
        chunk = min(prefill_chunk, max_len)
        return cls(_doubling(1, slots), pages, _doubling(min(16, chunk), chunk), chunk)

    def prefill_rows(self, chunk: int) -> list[int]:
        """The row buckets of a prefill of `chunk`-token pieces: as many as fit the token budget."""
        return [r for r in self.rows if r <= max(1, self.budget // chunk)]

    @staticmethod
    def fit(size: int, sizes: list[int]) -> int:
        return next(s for s in sizes if s >= size)


class Tokens(NamedTuple):
    """What a step produced, per row, with the model's raw log-probabilities (before
    temperature, top-k and top-p) when asked for (zeros otherwise)."""

    ids: jax.Array
    logprobs: jax.Array  # of each chosen token
    top_ids: jax.Array  # [.., TOP_LOGPROBS] the most likely tokens, most likely first
    top_logprobs: jax.Array


def _tokens(logits: jax.Array, ids: jax.Array, vocab_size: int) -> Tokens:
    """`ids` [rows] with their log-probs under `logits` [rows, padded vocab] and the top alternatives."""
    logprobs = jax.nn.log_softmax(jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf), axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
    chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
    return Tokens(ids, chosen, top_ids, top_logprobs)


def _without_logprobs(ids: jax.Array) -> Tokens:
    zeros = jnp.zeros(ids.shape, jnp.float32)
    top = jnp.zeros((*ids.shape, TOP_LOGPROBS), jnp.int32)
    return Tokens(ids, zeros, top, top.astype(jnp.float32))


class Slots(NamedTuple):
    """Per slot (and one scratch slot, the last, for padding rows): the token it feeds next and
    its request's sampling settings."""

    last: jax.Array
    sampling: Sampling

    @classmethod
    def empty(cls, slots: int) -> Slots:
        def zeros(dtype=jnp.int32):  # separate buffers, so the state can be donated
            return jnp.zeros(slots + 1, dtype)

        return cls(zeros(), Sampling(zeros(jnp.float32), zeros(), jnp.ones(slots + 1), zeros(jnp.uint32), zeros()))


Pools = tuple  # a KVCache's (keys, values)


def _replicated(logits: jax.Array) -> jax.Array:
    """One gather of the vocab-split logits, so sampling and log-probs run whole on each device."""
    return jax.lax.with_sharding_constraint(logits, P())


def decode(
    params: dict,
    pools: Pools,
    slots: Slots,
    rows: jax.Array,
    positions: jax.Array,
    index: jax.Array,
    table: jax.Array,
    logprobs: jax.Array,
    *,
    model: Model,
    vocab_size: int,
):
    """One token for each of `rows` [B] (slots), fed at `positions` [B] with its pages `table`
    [B, pages], drawn as the `index`-th [B] of its request's output: (pools, slots, `Tokens`,
    with log-probs if `logprobs`, a bool: their top-k over the vocab costs as much as sampling)."""
    tokens = slots.last[rows]
    logits, cache = model.extend(params, tokens[:, None], positions[:, None], KVCache(*pools, table))
    logits = _replicated(logits[:, -1])
    ids = sample(logits, jax.tree.map(lambda a: a[rows], slots.sampling), index, vocab_size)
    slots = slots._replace(last=slots.last.at[rows].set(ids))
    out = jax.lax.cond(
        logprobs, partial(_tokens, vocab_size=vocab_size), lambda _, ids: _without_logprobs(ids), logits, ids
    )
    return (cache.keys, cache.values), slots, out


def prefill(
    params: dict,
    pools: Pools,
    slots: Slots,
    rows: jax.Array,
    tokens: jax.Array,
    starts: jax.Array,
    lengths: jax.Array,
    table: jax.Array,
    final: jax.Array,
    sampling: Sampling,
    index: jax.Array,
    following: jax.Array,
    *,
    model: Model,
    vocab_size: int,
    logprobs: bool,
):
    """Chunks `tokens` [B, T] of which each row's first `lengths` count, at positions `starts`
    onwards, into the pages of `table`; a `final` row's chunk ends its prompt: its first token is
    drawn (the `index`-th of its output, with `sampling`, one entry per row) and becomes what its
    slot feeds next. (pools, slots, the first tokens as `Tokens`, and with `logprobs` each chunk
    token's prediction of the one `following` it [B, T] (else zeros): the LM head over every
    chunk token instead of once a row.)"""
    t = jnp.arange(tokens.shape[1])[None]
    positions = jnp.where(t < lengths[:, None], starts[:, None] + t, -1)
    cache = KVCache(*pools, table)
    if logprobs:
        logits, cache = model.extend(params, tokens, positions, cache)
        logits = _replicated(logits)
        b, length, vocab = logits.shape
        prompt = _tokens(logits.reshape(b * length, vocab), following.reshape(-1), vocab_size)
        prompt = jax.tree.map(lambda a: a.reshape(b, length, *a.shape[1:]), prompt)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    else:
        logits, cache = model.extend(params, tokens, positions, cache, logits_at=lengths - 1)
        last, prompt = _replicated(logits[:, 0]), _without_logprobs(following)
    first = sample(last, sampling, index, vocab_size)
    slots = Slots(
        slots.last.at[rows].set(jnp.where(final, first, slots.last[rows])),
        jax.tree.map(lambda all_slots, row: all_slots.at[rows].set(row), slots.sampling, sampling),
    )
    return (cache.keys, cache.values), slots, _tokens(last, first, vocab_size), prompt

"""The serving engine's device steps: continuous batching over a fixed number of slots.

A request's prompt is prefilled alone into a one-slot cache of its bucket's length (`prefill`:
prompts are padded to a few bucket lengths, so a few compiles cover them all), inserted into a
free slot of the decode state (`insert`), and then every active slot advances by one token per
`decode` step, all slots in one jitted call. Requests join and leave between steps; a slot's
tokens depend only on its request (see `sampling`), never on which slots are busy.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.config import ModelConfig
from jaxllm.model.cache import KVCache
from jaxllm.model.decoder import Model
from jaxllm.model.sampling import Sampling, sample

TOP_LOGPROBS = 20


def prompt_buckets(max_prompt_tokens: int, max_len: int) -> list[int]:
    """The lengths prompts are padded to, one compile each: powers of two from 16, up to and
    ending with min(max_prompt_tokens, max_len)."""
    top, sizes = min(max_prompt_tokens, max_len), []
    while (16 << len(sizes)) < top:
        sizes.append(16 << len(sizes))
    return [*sizes, top]


def bucket_for(length: int, buckets: list[int]) -> int:
    if not 0 < length <= buckets[-1]:
        raise ValueError(f"a prompt of {length} tokens does not fit: prompts take 1 to {buckets[-1]} tokens")
    return next(b for b in buckets if b >= length)


class Tokens(NamedTuple):
    """What a step produced, per slot, with the model's raw log-probabilities (before
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


class Prefix(NamedTuple):
    """A prefilled prompt, ready to insert into a slot."""

    cache: KVCache  # one slot's keys and values
    logits: jax.Array  # [padded vocab] fp32 after the prompt's last token
    length: jax.Array  # the prompt's true length
    prompt: Tokens  # [bucket - 1] the prompt's tokens after the first, with log-probs if asked for


class DecodeState(NamedTuple):
    """Every slot's cache and where its request stands; one entry per slot."""

    cache: KVCache
    tokens: jax.Array  # the token each slot feeds next (its latest output)
    positions: jax.Array  # where that token goes in the slot's cache
    generated: jax.Array  # how many tokens the slot's request has produced
    sampling: Sampling

    @classmethod
    def empty(cls, model: ModelConfig, slots: int, max_len: int, dtype=None) -> DecodeState:
        def zeros(dtype=jnp.int32):  # separate buffers, so the state can be donated
            return jnp.zeros(slots, dtype)

        sampling = Sampling(zeros(jnp.float32), zeros(), jnp.ones(slots), zeros(jnp.uint32), zeros())
        return cls(KVCache.empty(model, slots, max_len, dtype), zeros(), zeros(), zeros(), sampling)


def prefill(
    params: dict,
    tokens: jax.Array,
    length: jax.Array,
    *,
    model: Model,
    vocab_size: int,
    logprobs: bool,
    kv_dtype: str | None = None,
) -> Prefix:
    """`tokens` [bucket] (the prompt, then padding) of which the first `length` count, into a cache
    of `kv_dtype` (default: the model's). With `logprobs`, also each prompt token's log-prob (after
    the first) and the top alternatives, which costs the LM head over the whole prompt instead of once."""
    empty = KVCache.empty(model.config, 1, tokens.shape[0], kv_dtype)
    if not logprobs:
        logits, cache = model.prefill(params, tokens[None], empty, logits_at=(length - 1)[None])
        return Prefix(cache, logits[0, 0], length, _without_logprobs(tokens[1:]))
    logits, cache = model.prefill(params, tokens[None], empty)
    return Prefix(cache, logits[0, length - 1], length, _tokens(logits[0, :-1], tokens[1:], vocab_size))


def insert(prefix: Prefix, state: DecodeState, slot: jax.Array, sampling: Sampling, *, vocab_size: int):
    """The state with `prefix` in `slot`, decoding with `sampling` (one slot's settings); returns
    (state, the request's first token as `Tokens` of one slot). The slot's cache past the prompt
    keeps an earlier request's entries: decoding never attends past its own position."""
    first = sample(prefix.logits[None], sampling, jnp.zeros(1, jnp.int32), vocab_size)

    def put(all_slots, one):
        start = (0, 0, slot, 0, 0, 0)
        return jax.lax.dynamic_update_slice(all_slots, one.astype(all_slots.dtype), start)

    cache = jax.tree.map(put, state.cache, prefix.cache)
    state = DecodeState(
        cache,
        state.tokens.at[slot].set(first[0]),
        state.positions.at[slot].set(prefix.length),
        state.generated.at[slot].set(1),
        jax.tree.map(lambda all_slots, one: all_slots.at[slot].set(one[0]), state.sampling, sampling),
    )
    return state, _tokens(prefix.logits[None], first, vocab_size)


def decode(params: dict, state: DecodeState, logprobs: jax.Array, *, model: Model, vocab_size: int):
    """One step for every slot: (state, each slot's next token as `Tokens`, with log-probs if
    `logprobs`, a bool: their top-k over the vocab costs as much as sampling). Idle slots compute
    too; their positions stop at the cache's end."""
    positions = jnp.minimum(state.positions, state.cache.max_len - 1)
    logits, cache = model.decode_step(params, state.tokens[:, None], positions[:, None], state.cache)
    # One gather of the vocab-split logits, so sampling and log-probs run whole on each device.
    logits = jax.lax.with_sharding_constraint(logits[:, -1], P())
    tokens = sample(logits, state.sampling, state.generated, vocab_size)
    state = DecodeState(cache, tokens, positions + 1, state.generated + 1, state.sampling)

    return state, jax.lax.cond(
        logprobs, partial(_tokens, vocab_size=vocab_size), lambda _, ids: _without_logprobs(ids), logits, tokens
    )

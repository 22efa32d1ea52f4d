"""Next-token sampling for a batch of slots, each with its own settings: greedy, temperature,
top-k, top-p, min-p and seed; and the verification of proposed tokens (speculative decoding).

A draw's key is `fold_in(seed, choice, token_index)`: a pure function of the request (its seed,
which of its `n` choices, which token of the output), never of the slot or the step, so a request
generates the same text alone or among others, whenever it joined.

`verify` accepts a proposed token d with the probability p(d) the sampler would draw it, and on
a rejection draws from p without d: a proposal that is one token for sure (a lookup's, or a
greedy draft model's) is the special case q = δ(d) of speculative sampling's min(1, p/q) test
and max(0, p − q) residual, so every output token is distributed exactly as plain sampling's.
Greedy rows accept d when it is the argmax: their output is plain greedy decoding's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Sampling(NamedTuple):
    """Per-slot settings, each an array with one entry per slot."""

    temperature: jax.Array  # 0: greedy
    top_k: jax.Array  # 0: no limit
    top_p: jax.Array  # 1: no limit
    min_p: jax.Array  # 0: no limit
    seed: jax.Array
    choice: jax.Array  # which of a request's n choices the slot produces

    @classmethod
    def one(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, choice: int = 0,
            min_p: float = 0.0):  # fmt: skip
        """Settings for a single slot (host arrays: out-of-range values raise here, on the host)."""
        return cls(
            np.array([temperature], np.float32),
            np.array([top_k], np.int32),
            np.array([top_p], np.float32),
            np.array([min_p], np.float32),
            np.array([seed], np.uint32),
            np.array([choice], np.int32),
        )


def draw_key(seed: jax.Array, choice: jax.Array, token_index: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), choice), token_index)


def allowed(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """[vocab] bool: the tokens at least min-p times as likely as the likeliest, then the top-k of
    them (all if k = 0), cut to the fewest whose probability adds up to at least p (the order of
    vLLM's V1 engine).
    Ties at the cut are all kept."""
    floor = jnp.where(min_p > 0, jnp.max(logits) + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
    ordered = jnp.sort(jnp.where(logits >= floor, logits, -jnp.inf))[::-1]
    kth = jnp.where(top_k > 0, ordered[jnp.clip(top_k - 1, 0, logits.shape[-1] - 1)], -jnp.inf)
    ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered)
    before = jnp.cumsum(probs) - probs  # probability of the tokens ranked above each one
    last = jnp.where(top_p < 1, jnp.sum(before < top_p) - 1, logits.shape[-1] - 1)  # the last one needed
    return (logits >= floor) & (logits >= jnp.maximum(kth, ordered[last]))


def first_argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first of equal maxima) as two plain reductions: XLA:CPU
    runs argmax's paired (value, index) reduction several times slower over a large vocab."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(logits == top, index, logits.shape[-1]), axis=-1)


def unpack_mask(bits: jax.Array, width: int) -> jax.Array:
    """[rows, words] int32 bitmasks (token id i is bit i % 32 of word i // 32) → [rows, width] bool."""
    flags = (bits[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    flags = flags.reshape(bits.shape[0], -1)[:, :width].astype(bool)
    return jnp.pad(flags, ((0, 0), (0, width - flags.shape[1])))


def _allowed_logits(logits: jax.Array, vocab_size: int, mask: jax.Array | None) -> jax.Array:
    """fp32 logits, -inf for tokens never drawn: past `vocab_size` or outside `mask`."""
    keep = jnp.arange(logits.shape[-1]) < vocab_size
    if mask is not None:
        keep = keep & unpack_mask(mask, logits.shape[-1])
    return jnp.where(keep, logits.astype(jnp.float32), -jnp.inf)


def _scaled(logits: jax.Array, temperature, top_k, top_p, min_p, cut: bool) -> jax.Array:
    """One row's logits as a sampled row draws from them: tempered, and (with `cut`) min-p/top-k/p cut."""
    scaled = logits / jnp.maximum(temperature, 1e-6)
    return jnp.where(allowed(scaled, top_k, top_p, min_p), scaled, -jnp.inf) if cut else scaled


def _by_need(sampling: Sampling, greedy: Callable, sampled: Callable) -> jax.Array:
    """`greedy()` when no row samples, else `sampled(cut)`, `cut` whether some sampled row cuts
    min-p/top-k/p: work no row needs (the draw, the sort) is skipped."""
    rows = sampling.temperature > 0
    cuts = jnp.any(rows & ((sampling.top_k > 0) | (sampling.top_p < 1) | (sampling.min_p > 0)))
    which = jnp.where(jnp.any(rows), 1 + cuts.astype(jnp.int32), 0)
    return jax.lax.switch(which, [greedy, lambda: sampled(False), lambda: sampled(True)])


def sample(
    logits: jax.Array,
    sampling: Sampling,
    token_index: jax.Array,
    vocab_size: int,
    mask: jax.Array | None = None,
    exclude: jax.Array | None = None,
) -> jax.Array:
    """[slots] int32 tokens from [slots, vocab] logits (any padding past `vocab_size` is never
    drawn), with `mask` [slots, words] a bitmask of the tokens each slot may draw (see
    `unpack_mask`) and `exclude` [slots] a token each may not (-1: none), taken out after the
    min-p/top-k/p cut, so the rest keep the probabilities they had."""
    logits = _allowed_logits(logits, vocab_size, mask)
    exclude = jnp.full(logits.shape[0], -1) if exclude is None else exclude
    kept = jnp.arange(logits.shape[-1]) != exclude[:, None]
    greedy = first_argmax(jnp.where(kept, logits, -jnp.inf))

    def draw(cut: bool):
        def one(logits, kept, temperature, top_k, top_p, min_p, seed, choice, index):
            scaled = jnp.where(kept, _scaled(logits, temperature, top_k, top_p, min_p, cut), -jnp.inf)
            return jax.random.categorical(draw_key(seed, choice, index), scaled).astype(jnp.int32)

        return jnp.where(sampling.temperature > 0, jax.vmap(one)(logits, kept, *sampling, token_index), greedy)

    return _by_need(sampling, lambda: greedy, draw)


def probability(
    logits: jax.Array, sampling: Sampling, tokens: jax.Array, vocab_size: int, mask: jax.Array | None = None
) -> jax.Array:
    """[slots] the probability that `sample` draws `tokens` [slots] from `logits` (1 or 0 for a
    greedy slot)."""
    logits = _allowed_logits(logits, vocab_size, mask)
    greedy = (first_argmax(logits) == tokens).astype(jnp.float32)

    def sampled(cut: bool):
        def one(logits, temperature, top_k, top_p, min_p, token):
            return jax.nn.softmax(_scaled(logits, temperature, top_k, top_p, min_p, cut))[token]

        return jnp.where(sampling.temperature > 0, jax.vmap(one)(logits, *sampling[:4], tokens), greedy)

    return _by_need(sampling, lambda: greedy, sampled)


def verify(
    logits: jax.Array,
    drafts: jax.Array,
    sampling: Sampling,
    token_index: jax.Array,
    vocab_size: int,
    mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Checks each row's proposed tokens `drafts` [rows, K] (-1 past a row's last) against the
    target's `logits` [rows, K + 1, vocab] at the positions they fill (and the one after):
    (tokens [rows, K + 1], accepted [rows]). A row's output is its first `accepted` drafts, then
    `tokens[accepted]`, a correction of the first rejected draft (or, all accepted, one more
    token); its later tokens mean nothing. Position j draws output token `token_index + j` by the
    request's key for it, as plain sampling does; `mask` [rows, words] constrains every position."""
    rows, positions, vocab = logits.shape
    proposed = jnp.concatenate([drafts, jnp.full((rows, 1), -1, drafts.dtype)], axis=1)
    index = token_index[:, None] + jnp.arange(positions)
    every = partial(jax.tree.map, lambda a: jnp.repeat(a, positions, axis=0))  # a row's value at each position
    flat = logits.reshape(rows * positions, vocab), proposed.reshape(-1), index.reshape(-1)
    logits, proposed, index = flat
    sampling, mask = every(sampling), None if mask is None else every(mask)
    odds = probability(logits, sampling, jnp.maximum(proposed, 0), vocab_size, mask)

    def uniform():  # a distinct stream from the residual draw's
        keys = jax.vmap(draw_key)(sampling.seed, sampling.choice, index)
        return jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(keys)

    # A greedy row's odds are 1 or 0, so a uniform of 0 decides it: no draws where no row samples.
    draws = jax.lax.cond(jnp.any(sampling.temperature > 0), uniform, lambda: jnp.zeros(odds.shape))
    accept = (proposed >= 0) & (draws < odds)
    residual = sample(logits, sampling, index, vocab_size, mask, exclude=proposed)
    tokens = jnp.where(accept, proposed, residual).reshape(rows, positions)
    accepted = jnp.sum(jnp.cumprod(accept.reshape(rows, positions), axis=1), axis=1)
    return tokens, accepted

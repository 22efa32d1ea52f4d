"""Next-token sampling for a batch of slots, each with its own settings: greedy, temperature,
top-k, top-p and seed.

A draw's key is `fold_in(seed, choice, token_index)`: a pure function of the request (its seed,
which of its `n` choices, which token of the output), never of the slot or the step, so a request
generates the same text alone or among others, whenever it joined.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Sampling(NamedTuple):
    """Per-slot settings, each an array with one entry per slot."""

    temperature: jax.Array  # 0: greedy
    top_k: jax.Array  # 0: no limit
    top_p: jax.Array  # 1: no limit
    seed: jax.Array
    choice: jax.Array  # which of a request's n choices the slot produces

    @classmethod
    def one(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, choice: int = 0):
        """Settings for a single slot (host arrays: out-of-range values raise here, on the host)."""
        return cls(
            np.array([temperature], np.float32),
            np.array([top_k], np.int32),
            np.array([top_p], np.float32),
            np.array([seed], np.uint32),
            np.array([choice], np.int32),
        )


def draw_key(seed: jax.Array, choice: jax.Array, token_index: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), choice), token_index)


def allowed(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[vocab] bool: the top-k tokens (all if k = 0), cut to the fewest whose probability adds up
    to at least p. Ties at the cut are all kept."""
    ordered = jnp.sort(logits)[::-1]
    kth = jnp.where(top_k > 0, ordered[jnp.clip(top_k - 1, 0, logits.shape[-1] - 1)], -jnp.inf)
    ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered)
    before = jnp.cumsum(probs) - probs  # probability of the tokens ranked above each one
    last = jnp.where(top_p < 1, jnp.sum(before < top_p) - 1, logits.shape[-1] - 1)  # the last one needed
    return logits >= jnp.maximum(kth, ordered[last])


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


def sample(
    logits: jax.Array, sampling: Sampling, token_index: jax.Array, vocab_size: int, mask: jax.Array | None = None
) -> jax.Array:
    """[slots] int32 tokens from [slots, vocab] logits (any padding past `vocab_size` is never
    drawn), with `mask` [slots, words] a bitmask of the tokens each slot may draw (see
    `unpack_mask`). Work no slot needs is skipped: the draw when all are greedy, the sort when
    none cuts top-k/p."""
    keep = jnp.arange(logits.shape[-1]) < vocab_size
    if mask is not None:
        keep = keep & unpack_mask(mask, logits.shape[-1])
    logits = jnp.where(keep, logits.astype(jnp.float32), -jnp.inf)
    greedy = first_argmax(logits)

    def draw(cut: bool):
        def one(logits, temperature, top_k, top_p, seed, choice, index):
            scaled = logits / jnp.maximum(temperature, 1e-6)
            if cut:
                scaled = jnp.where(allowed(scaled, top_k, top_p), scaled, -jnp.inf)
            return jax.random.categorical(draw_key(seed, choice, index), scaled).astype(jnp.int32)

        return lambda: jnp.where(sampling.temperature > 0, jax.vmap(one)(logits, *sampling, token_index), greedy)

    sampled = sampling.temperature > 0
    cuts = jnp.any(sampled & ((sampling.top_k > 0) | (sampling.top_p < 1)))
    which = jnp.where(jnp.any(sampled), 1 + cuts.astype(jnp.int32), 0)
    return jax.lax.switch(which, [lambda: greedy, draw(cut=False), draw(cut=True)])

"""Prompt lookup (serve.speculative=ngram), on the device: where the context's last n tokens
occurred before (in the prompt or the output so far), the tokens that followed them there are
proposed to follow again, the longest n first and the latest occurrence of it; where what followed
runs into the present (a loop of a few tokens), the proposal goes on around it. Text that repeats
(code being edited, a summary quoting its source, a retrieved passage) is proposed whole; text
that does not is proposed nothing.

Looking up where the tokens are, in the step that verifies the proposal, means no step waits for
the host to read the last one's tokens before it can propose: a speculating sequence's steps follow
one another as plain decoding's do. The tokens sit in a pool of the KV cache's pages
(`write`), so a prompt's pages shared by the prefix cache bring their tokens with them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.model.cache import locate


def empty(pages: int, page_size: int) -> jax.Array:
    """A pool of `pages` pages of `page_size` tokens."""
    return jnp.zeros((pages, page_size), jnp.int32)


def write(pool: jax.Array, table: jax.Array, positions: jax.Array, tokens: jax.Array) -> jax.Array:
    """`pool` with `tokens` [b, t] at `positions` [b, t] of the pages `table` [b, P] names (-1: the
    scratch page)."""
    page, offset = locate(table, positions, pool.shape[1])
    return pool.at[page, offset].set(tokens)


def read(pool: jax.Array, table: jax.Array, positions: jax.Array) -> jax.Array:
    """The tokens at `positions` [b, t] of the pages `table` [b, P] names (-1: the scratch page's)."""
    page, offset = locate(table, positions, pool.shape[1])
    return pool[page, offset]


def context(pool: jax.Array, table: jax.Array, last: jax.Array, at: jax.Array) -> jax.Array:
    """Each row's tokens in position order, with `last` [b] (not in the pool yet) at `at` [b]:
    [b, P × page_size + 1], room for a token just past the pages."""
    tokens = jnp.pad(pool[table].reshape(table.shape[0], -1), ((0, 0), (0, 1)))
    return tokens.at[jnp.arange(table.shape[0]), at].set(last)


def propose(tokens: jax.Array, length: jax.Array, count: int, shortest: int, longest: int) -> jax.Array:
    """[b, count] tokens proposed to follow each row's first `length` [b] of `tokens` [b, L]: what
    followed the latest earlier occurrence of its last n tokens, for the largest n in [shortest,
    longest] that has one, copied on around itself where it reaches the end; -1 where none has."""
    size = tokens.shape[1]
    last = length - 1  # the index of each row's last token
    ends = jnp.arange(size)[None]  # where an earlier occurrence may end: before the last token
    matched = ends < last[:, None]
    found = jnp.full(length.shape, -1)
    for j in range(longest):  # the runs of j + 1 tokens that end at each index and equal the last ones
        earlier = jnp.pad(tokens, ((0, 0), (j, 0)), constant_values=-1)[:, :size]  # the token j before
        matched &= earlier == jnp.take_along_axis(tokens, jnp.maximum(last - j, 0)[:, None], axis=1)
        if j + 1 >= shortest:
            latest = jnp.max(jnp.where(matched & (j < last[:, None]), ends, -1), axis=1)
            found = jnp.where(latest >= 0, latest, found)
    period = jnp.maximum(last - found, 1)  # what followed runs into the present: it repeats
    follows = found[:, None] + 1 + jnp.arange(count)[None] % period[:, None]
    proposed = jnp.take_along_axis(tokens, jnp.clip(follows, 0, size - 1), axis=1)
    return jnp.where(found[:, None] >= 0, proposed, -1)

"""The serving engine's device steps over a paged KV cache (see `model.cache`), each taking one
of `batches`' named batches.

`prefill` reads a chunk of up to T tokens for each of B rows (a prompt whole, or a piece of a
long one) into the pages each row's table names, attending to what those pages already hold;
a row whose chunk ends its prompt samples its first token. `decode` advances B decoding rows by
one token each, or, given up to K proposed tokens a row (speculative decoding), feeds them after
it in the same step and keeps those the model would have drawn (`sampling.verify`) and one more:
one read of the weights for several tokens. The proposals are made on the device in the same
step, so no step waits for the host: by prompt lookup (`serve.speculative=ngram`, see `lookup`)
over the tokens every step writes beside the cache's pages, or as a draft model's greedy
continuations (`serve.speculative=draft`), whose keys and values follow the target's pages: a
prefill writes them, and a verify step's draft reads what the plain steps since its last one fed.
Both take each row's slot, a row of `Slots`: the token it feeds next and its
sampling settings stay on the device, so one decode step can be dispatched before the host has
read the last one's tokens. B, T and the table's width come in a few bucket sizes (`buckets`),
each compiled when the engine starts. A row draws only tokens its mask allows (a structured
output's grammar), and its tokens depend only on its request (see `sampling`), never on its
neighbours.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.model.cache import KVCache
from jaxllm.model.decoder import Model
from jaxllm.model.sampling import Sampling, first_argmax, sample, verify
from jaxllm.serve import lookup
from jaxllm.serve.batches import PADDING_SAMPLING, DecodeBatch, PrefillBatch
from jaxllm.serve.generation import TOP_LOGPROBS, Tokens
from jaxllm.serve.settings import LONGEST_BACK_OFF


def _tokens(logits: jax.Array, ids: jax.Array, vocab_size: int) -> Tokens:
    """`ids` [rows] with their log-probs under `logits` [rows, padded vocab] and the top alternatives."""
    logprobs = jax.nn.log_softmax(jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf), axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
    chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
    return Tokens(ids, chosen, top_ids, top_logprobs)


def _bare(logits: jax.Array, ids: jax.Array) -> Tokens:
    """A `jax.lax.cond` branch beside `_tokens`: `ids` without log-probs."""
    return Tokens.without_logprobs(ids, jnp)


class Slots(NamedTuple):
    """Per slot (and one scratch slot, the last, for padding rows): the token it feeds next, its
    request's sampling settings, the draft tokens its verify steps rejected since its prefill
    (the host counts them only once it reads them; see `decode`), and the position up to which a
    draft model has read its tokens (see `_drafted`); and the token at each position of the
    cache's pages, where prompt lookup reads a row's context (see `lookup`)."""

    last: jax.Array
    sampling: Sampling
    rejected: jax.Array
    draft_read: jax.Array
    tokens: jax.Array  # [pages, page_size]

    @classmethod
    def empty(cls, slots: int, pages: int, page_size: int) -> Slots:
        def zeros(dtype=jnp.int32):  # separate buffers, so the state can be donated
            return jnp.zeros(slots + 1, dtype)

        sampling = Sampling(*(jnp.full(slots + 1, v) for v in PADDING_SAMPLING))  # empty slots decode as padding
        return cls(zeros(), sampling, zeros(), zeros(), lookup.empty(pages, page_size))


Pools = tuple  # a KVCache's (keys, values)


def _replicated(logits: jax.Array) -> jax.Array:
    """One gather of the vocab-split logits, so sampling and log-probs run whole on each device."""
    return jax.lax.with_sharding_constraint(logits, P())


def decode(
    params: dict,
    pools: Pools,
    slots: Slots,
    batch: DecodeBatch,
    draft_params: dict | None = None,
    draft_pools: Pools | None = None,
    *,
    model: Model,
    vocab_size: int,
    draft: Model | None = None,
    ngram: tuple[int, int] | None = None,
):
    """A token for each row of `batch`, after its accepted drafts if it has any: (pools, slots,
    `Tokens` with log-probs if the batch asks, the draft model's pools, `recurs`). Without drafts
    (K = 0) the tokens are [B]; with them [B, K + 1], each row's output in order, then -2 for each
    draft it rejected and -1 past them. A row's drafts (of `batch.drafts`, only how many it wants)
    are the `draft` model's, or without one prompt lookup's (`lookup.propose`, runs of `ngram`'s
    (shortest, longest) tokens). A step in which no row has a draft runs as a plain one. Keys
    and values of rejected drafts stay in the pages past the row's position, where nothing reads
    them before a later token overwrites them. With `ngram` and no draft model, `recurs` [B] says
    whether the lookup finds a proposal after the row's new token (None otherwise): the host
    asks for drafts where it does, so text that does not repeat decodes by plain steps.

    A row's position and output index are the host's less the drafts rejected in steps it has
    not read yet (`batch.rejected` counts those it has): so a step may follow a verify step
    before the host knows how many tokens that one accepted."""
    rows, k = batch.slots, batch.drafts.shape[1]
    unread = slots.rejected[rows] - batch.rejected
    positions = jnp.where(batch.positions >= 0, batch.positions - unread, -1)
    batch = batch._replace(positions=positions, index=batch.index - unread)
    wanted = jnp.sum(batch.drafts >= 0, axis=1)
    last = slots.last[rows]
    if draft is not None and k:
        read = slots.draft_read[rows]
        drafts, draft_pools = _drafted(draft, draft_params, draft_pools, slots.tokens, read, last, batch, vocab_size)
    elif k:
        context = lookup.context(slots.tokens, batch.table, last, positions)
        drafts = jnp.where(batch.drafts >= 0, lookup.propose(context, positions + 1, k, *ngram), -1)
    else:
        drafts = batch.drafts
    fed = jnp.concatenate([last[:, None], jnp.maximum(drafts, 0)], axis=1)  # [B, K + 1]
    j = jnp.arange(k + 1)[None]
    proposed = jnp.sum(drafts >= 0, axis=1, keepdims=True)
    fed_at = jnp.where((j <= proposed) & (positions[:, None] >= 0), positions[:, None] + j, -1)
    sampling = jax.tree.map(lambda a: a[rows], slots.sampling)
    tokens = partial(_tokens, vocab_size=vocab_size)

    def plain(pools):  # the fed token alone: [B] tokens
        logits, cache = model.extend(params, fed[:, :1], fed_at[:, :1], KVCache(*pools, batch.table))
        logits = _replicated(logits)[:, 0]
        ids = sample(logits, sampling, batch.index, vocab_size, batch.allowed)
        out = jax.lax.cond(batch.logprobs, tokens, _bare, logits, ids)
        return (cache.keys, cache.values), out

    def verifying(pools):
        logits, cache = model.extend(params, fed, fed_at, KVCache(*pools, batch.table))
        logits = _replicated(logits)
        ids, accepted = verify(logits, drafts, sampling, batch.index, vocab_size, batch.allowed)
        ids = jnp.where(j <= accepted[:, None], ids, jnp.where(j <= proposed, -2, -1))
        over_positions = partial(_over_positions, tokens)
        out = jax.lax.cond(batch.logprobs, over_positions, _bare, logits, ids)
        return (cache.keys, cache.values), out, accepted

    def unverified(pools):  # no row has a draft: a plain step's cost, its tokens as a verify step's
        pools, out = plain(pools)
        return pools, _followed_by_nothing(out, k), jnp.zeros_like(wanted)

    if k:
        pools, out, accepted = _either(jnp.any(drafts >= 0), verifying, unverified, pools)
        new = jnp.take_along_axis(out.ids, accepted[:, None], axis=1)[:, 0]
        slots = slots._replace(rejected=slots.rejected.at[rows].add(wanted - accepted))
    else:
        pools, out = plain(pools)
        new = out.ids
    tokens_fed = lookup.write(slots.tokens, batch.table, fed_at, fed)
    slots = slots._replace(last=slots.last.at[rows].set(new), tokens=tokens_fed)
    if draft is not None and k:  # it read the fed token and the proposals it made, of which the target kept `accepted`
        read = positions + 1 + jnp.minimum(accepted, k - 1)
        slots = slots._replace(draft_read=slots.draft_read.at[rows].set(jnp.where(positions >= 0, read, -1)))
    recurs = None
    if draft is None and ngram is not None:  # whether the next step's lookup will find something
        at = jnp.where(positions >= 0, positions + 1 + (accepted if k else 0), -1)  # where `new` goes
        context = lookup.context(tokens_fed, batch.table, new, at)
        shortest = ngram[0]  # a longer run that recurs holds a shortest one that does
        recurs = lookup.propose(context, at + 1, 1, shortest, shortest)[:, 0] >= 0
    return pools, slots, out, draft_pools, recurs


def _either(pred, if_true, if_false, state):
    """`jax.lax.cond(pred, if_true, if_false, state)` for branches that return (state, *outputs),
    as two loops of 0 or 1 trips: XLA updates a loop's carried buffers (the cache) in place, where
    a conditional's branches copy them."""
    outputs = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(if_true, state)[1:])

    def run(branch, when, carry):
        def body(trip_carry):
            trip, carry = trip_carry
            return trip + 1, branch(carry[0])

        return jax.lax.while_loop(lambda trip_carry: (trip_carry[0] < 1) & when, body, (0, carry))[1]

    return run(if_false, ~pred, run(if_true, pred, (state, *outputs)))


def _followed_by_nothing(out: Tokens, k: int) -> Tokens:
    """[B] `Tokens` as a verify step's [B, K + 1], -1 past the first."""

    def padded(a, fill):
        return jnp.concatenate([a[:, None], jnp.full((a.shape[0], k, *a.shape[1:]), fill, a.dtype)], axis=1)

    return Tokens(padded(out.ids, -1), *(padded(a, 0) for a in out[1:]))


def _drafted(
    draft: Model,
    params: dict,
    pools: Pools,
    pool: jax.Array,
    read: jax.Array,
    fed: jax.Array,
    batch: DecodeBatch,
    vocab_size: int,
):
    """(drafts [B, K], the draft's pools): the draft model's greedy continuation of each row's fed
    token, as many tokens as the row's entries of `batch.drafts` that are not -1 (0 for a row
    that does not speculate, whose fed token is read all the same). A draft followed by the
    target is lossless: `verify` keeps a proposed token with the target's probability of it.

    The draft reads only in steps that verify: its cache holds each row's tokens below `read`
    [B], and its first call reads the tokens from there to the fed one (from `pool`, the tokens
    at the cache's positions; see `lookup`): none, or a last proposal that the step before kept
    (the draft reads each proposal as it makes the next, so K calls make K), or the tokens of
    plain steps since a back-off began, up to `LONGEST_BACK_OFF` + K (a back-off counts from the
    tokens issued, a step in flight's drafts among them; a wider call, only in a step where some
    row needs it). So plain steps, where no row speculates, cost the draft nothing."""
    wanted = jnp.sum(batch.drafts >= 0, axis=1)
    live = batch.positions >= 0

    def call(tokens, positions, pools):  # (pools, the proposal after each row's last token)
        last = jnp.full(tokens.shape[0], tokens.shape[1] - 1)
        logits, cache = draft.extend(params, tokens, positions, KVCache(*pools, batch.table), last)
        return (cache.keys, cache.values), first_argmax(logits[:, 0, :vocab_size])

    def catch_up(width, pools):  # reads the `width` - 1 tokens before the fed one where unread, and the fed one
        at = batch.positions[:, None] + jnp.arange(1 - width, 1)
        at = jnp.where(live[:, None] & (at >= read[:, None]) & (at >= 0), at, -1)
        tokens = lookup.read(pool, batch.table, at).at[:, -1].set(fed)  # the fed token is not in the pool yet
        return call(tokens, at, pools)

    behind = jnp.any(live & (batch.positions - read > 1))
    wide = LONGEST_BACK_OFF + batch.drafts.shape[1] + 1
    pools, first = _either(behind, partial(catch_up, wide), partial(catch_up, 2), pools)

    def step(carry, j):
        token, pools = carry
        positions = jnp.where(live & (j <= wanted), batch.positions + j, -1)[:, None]
        pools, following = call(token[:, None], positions, pools)
        return (following, pools), following

    (_, pools), proposed = jax.lax.scan(step, (first, pools), jnp.arange(1, batch.drafts.shape[1]))
    proposed = jnp.concatenate([first[:, None], proposed.T], axis=1)
    return jnp.where(batch.drafts >= 0, proposed, -1), pools


def _over_positions(tokens, logits: jax.Array, ids: jax.Array) -> Tokens:
    """`tokens(logits, ids)` for [B, T, vocab] logits and [B, T] ids, as [B, T] `Tokens`."""
    b, length, vocab = logits.shape
    out = tokens(logits.reshape(b * length, vocab), ids.reshape(-1))
    return jax.tree.map(lambda a: a.reshape(b, length, *a.shape[1:]), out)


def prefill(
    params: dict,
    pools: Pools,
    slots: Slots,
    batch: PrefillBatch,
    draft_params: dict | None = None,
    draft_pools: Pools | None = None,
    *,
    model: Model,
    vocab_size: int,
    logprobs: bool,
    draft: Model | None = None,
):
    """Chunks `batch.tokens` into the pages of its table, attending to what they already hold; a
    `final` row's chunk ends its prompt: its first token is drawn (with the row's sampling
    settings, which its slot keeps) and becomes what its slot feeds next. (pools, slots, the first
    tokens as `Tokens`, and with `logprobs` each chunk token's prediction of the one following it
    [B, T] (else zeros): the LM head over every chunk token instead of once a row; the `draft`
    model's pools, the chunk written into them too.)"""
    tokens, lengths, rows = batch.tokens, batch.lengths, batch.slots
    t = jnp.arange(tokens.shape[1])[None]
    positions = jnp.where(t < lengths[:, None], batch.starts[:, None] + t, -1)
    if draft is not None:  # its logits go unused: only its cache is written
        draft_cache = draft.extend(draft_params, tokens, positions, KVCache(*draft_pools, batch.table), lengths - 1)[1]
        draft_pools = (draft_cache.keys, draft_cache.values)
    cache = KVCache(*pools, batch.table)
    if logprobs:
        logits, cache = model.extend(params, tokens, positions, cache)
        logits = _replicated(logits)
        prompt = _over_positions(partial(_tokens, vocab_size=vocab_size), logits, batch.following)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    else:
        logits, cache = model.extend(params, tokens, positions, cache, logits_at=lengths - 1)
        last, prompt = _replicated(logits[:, 0]), Tokens.without_logprobs(batch.following, jnp)
    sampling = Sampling(*batch.sampling)
    first = sample(last, sampling, batch.index, vocab_size, batch.allowed)
    slots = Slots(
        slots.last.at[rows].set(jnp.where(batch.final, first, slots.last[rows])),
        jax.tree.map(lambda all_slots, row: all_slots.at[rows].set(row), slots.sampling, sampling),
        slots.rejected.at[rows].set(0),
        slots.draft_read.at[rows].set(batch.starts + lengths),
        lookup.write(slots.tokens, batch.table, positions, tokens),
    )
    return (cache.keys, cache.values), slots, _tokens(last, first, vocab_size), prompt, draft_pools

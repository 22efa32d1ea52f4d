"""What the host sends the device for one step, by name: a `DecodeBatch` (a token for each
decoding row) and a `PrefillBatch` (a chunk of prompt for each prefilling row), numpy arrays
padded to one of the compiled shapes (`buckets`). Padding rows use the scratch slot, position -1
and the scratch page, and may draw any token; an unconstrained row's mask allows every token."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from jaxllm.serve.pages import SCRATCH_PAGE
from jaxllm.serve.scheduler import Chunk, Sequence

# A padding row's settings (greedy), in `RowSampling`'s order and each field's dtype.
PADDING_SAMPLING = (np.float32(0), np.int32(0), np.float32(1), np.float32(0), np.uint32(0), np.int32(0))


class RowSampling(NamedTuple):
    """Each row's sampling settings (the fields of `model.sampling.Sampling`, in its order)."""

    temperature: np.ndarray  # 0: greedy
    top_k: np.ndarray  # 0: no limit
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    choice: np.ndarray  # which of its request's n choices a row draws for


class DecodeBatch(NamedTuple):
    slots: np.ndarray  # [B] each row's slot: what it feeds next and its sampling settings stay there
    positions: np.ndarray  # [B] where the fed token goes
    index: np.ndarray  # [B] which token of its output the row draws
    table: np.ndarray  # [B, pages] the row's pages
    logprobs: Any  # a bool: report log-probs (their top-k over the vocab costs as much as sampling)
    allowed: np.ndarray  # [B, words] int32 bitmask of the tokens a row may draw
    drafts: np.ndarray  # [B, K] 0 where the row wants a token proposed by the device (-1: not); K may be 0
    rejected: np.ndarray  # [B] the row's rejected drafts the host has read since its prefill (see `steps.decode`)


class PrefillBatch(NamedTuple):
    slots: np.ndarray  # [B]
    tokens: np.ndarray  # [B, T] a chunk of each row's prompt (and output so far, after preemption)
    starts: np.ndarray  # [B] the chunk's first position
    lengths: np.ndarray  # [B] the chunk's tokens (the rest of its T is padding)
    table: np.ndarray  # [B, pages]
    final: np.ndarray  # [B] the chunk ends its prompt: the row draws its first token
    sampling: RowSampling
    index: np.ndarray  # [B] which output token a final row draws
    following: np.ndarray  # [B, T] the token after each chunk token, whose log-prob a prompt's score needs
    allowed: np.ndarray  # [B, words]


@dataclasses.dataclass(frozen=True)
class PrefillRow:
    """One chunk's row of a `PrefillBatch`, checked on its own: a request whose settings cannot
    make a row fails alone."""

    chunk: Chunk
    sampling: tuple  # a `RowSampling` of one row's values
    allowed: np.ndarray | None  # a final chunk's constraint on its first token

    @classmethod
    def of(cls, chunk: Chunk, allowed: np.ndarray | None) -> PrefillRow:
        s, request = chunk.sequence, chunk.sequence.generation.request
        settings = (request.temperature, request.top_k, request.top_p, request.min_p, s.generation.seed, s.choice)
        typed = tuple(np.array(v, p.dtype) for v, p in zip(settings, PADDING_SAMPLING, strict=True))
        return cls(chunk, typed, allowed)


def _padded(rows: int, slots: int, width: int, words: int) -> tuple:
    return (
        np.full(rows, slots, np.int32),
        np.zeros(rows, np.int32),
        np.full((rows, width), SCRATCH_PAGE, np.int32),
        np.full((rows, words), -1, np.int32),
    )


def decode_batch(
    sequences: list[Sequence],
    masks: dict[Sequence, np.ndarray],
    rows: int,
    width: int,
    slots: int,
    words: int,
    drafts: int = 0,
) -> DecodeBatch:
    """`sequences` (those in `masks` constrained by their mask) padded to `rows` rows, tables of
    `width` pages and room for `drafts` proposed tokens a row (each sequence wants its `drafts`);
    `slots` is the scratch slot."""
    slot, index, table, allowed = _padded(rows, slots, width, words)
    positions, wanted = np.full(rows, -1, np.int32), np.full((rows, drafts), -1, np.int32)
    rejected = np.zeros(rows, np.int32)
    for r, s in enumerate(sequences):
        slot[r], positions[r], index[r], rejected[r] = s.slot, s.position, s.issued, s.rejected
        table[r, : len(s.pages)], wanted[r, : s.drafts] = s.pages, 0
        if s in masks:
            allowed[r] = masks[s]
    logprobs = any(s.generation.request.logprobs is not None for s in sequences)
    return DecodeBatch(slot, positions, index, table, np.bool_(logprobs), allowed, wanted, rejected)


def prefill_batch(rows: list[PrefillRow], count: int, size: int, width: int, slots: int, words: int) -> PrefillBatch:
    """`rows` padded to `count` rows of `size` tokens and tables of `width` pages."""
    slot, index, table, allowed = _padded(count, slots, width, words)
    starts, lengths, final = np.zeros(count, np.int32), np.ones(count, np.int32), np.zeros(count, np.bool_)
    tokens, following = np.zeros((count, size), np.int32), np.zeros((count, size), np.int32)
    sampling = RowSampling(*(np.repeat(v, count) for v in PADDING_SAMPLING))
    for r, row in enumerate(rows):
        chunk = row.chunk
        s = chunk.sequence
        slot[r], starts[r], lengths[r], final[r], index[r] = s.slot, chunk.start, chunk.count, chunk.final, s.issued
        after = s.target[chunk.start + 1 : chunk.start + chunk.count + 1]
        tokens[r, : chunk.count], following[r, : len(after)], table[r, : len(s.pages)] = chunk.tokens, after, s.pages
        for field, value in zip(sampling, row.sampling, strict=True):
            field[r] = value
        if row.allowed is not None:
            allowed[r] = row.allowed
    return PrefillBatch(slot, tokens, starts, lengths, table, final, sampling, index, following, allowed)

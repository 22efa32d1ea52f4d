"""Proposals for speculative decoding, on the host: prompt lookup ('ngram'). Where the context's
last n tokens occurred before (in the prompt or the output so far), the tokens that followed them
there are proposed to follow again, the longest n first and the latest occurrence of it; where
what followed runs into the present (a loop of a few tokens), the proposal goes on around it. Text
that repeats (code being edited, a summary quoting its source, a retrieved passage) is proposed
whole; text that does not is proposed nothing, and decodes as without speculation.

`propose` gives each speculating sequence its draft before a step (with a draft model, only its
length), and `back_off` spaces out a sequence's proposals while they miss.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jaxllm.serve.scheduler import Sequence, State
from jaxllm.serve.settings import ServeConfig


def lookup(context: list[int], count: int, longest: int, shortest: int) -> list[int]:
    """`count` tokens that followed the latest earlier occurrence of `context`'s last n tokens,
    for the largest n from `longest` down to `shortest` that has one (copied on from the proposal
    itself where they reach the context's end); [] if none has."""
    tokens = np.asarray(context, np.int64)
    for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
        earlier = sliding_window_view(tokens[:-1], n)  # every run of n tokens but the last one
        found = np.flatnonzero((earlier == tokens[-n:]).all(axis=1))
        if found.size:
            extended, start = tokens.tolist(), found[-1] + n
            for i in range(count):
                extended.append(extended[start + i])
            return extended[len(tokens) :]
    return []


def propose(sequence: Sequence, settings: ServeConfig) -> None:
    """Sets `sequence.draft` (empty if it does not speculate now), never past its max_tokens; a
    lookup that finds nothing backs off. Prompt lookup does not wait for the token of a plain step
    still on the device: it proposes that token too, as it would any, and drafts the tokens after
    it. Verification keeps only the tokens the model would draw, whatever was proposed, so a draft
    after a wrong guess costs only speed. After a verify step (more than one token unread) and
    with a draft model, which drafts from the last token on the device, the sequence waits."""
    s = settings
    sequence.draft = []
    unread = sequence.issued - len(sequence.output)
    may_guess = 1 if s.speculative == "ngram" else 0  # unread tokens a proposal may run ahead of
    if not (sequence.speculates and sequence.state is State.DECODE and unread <= may_guess):
        return
    room = min(s.draft_tokens, sequence.generation.request.max_tokens - sequence.issued - 1)
    if room <= 0 or sequence.issued < sequence.resume_at:
        return
    if s.speculative == "draft":
        sequence.draft = [0] * room  # how many: the draft model proposes them on the device
        return
    proposal = lookup(sequence.prompt + sequence.output, unread + room, s.ngram_max, s.ngram_min)
    sequence.draft = proposal[unread:]
    if not proposal:
        back_off(sequence)


def back_off(sequence: Sequence) -> None:
    """After a proposal that found nothing or had nothing accepted: propose nothing for the next
    1, 2, 4, ... 32 tokens (misses in a row), decoding them without waiting for each to be read,
    as text that does not repeat decodes at the pace it would without speculation."""
    sequence.resume_at = sequence.issued + 2 ** min(sequence.misses, 5)
    sequence.misses += 1

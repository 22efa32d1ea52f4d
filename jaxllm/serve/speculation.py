"""Proposals for speculative decoding, on the host: prompt lookup ('ngram'). Where the context's
last n tokens occurred before (in the prompt or the output so far), the tokens that followed them
there are proposed to follow again, the longest n first and the latest occurrence of it; where
what followed runs into the present (a loop of a few tokens), the proposal goes on around it. Text
that repeats (code being edited, a summary quoting its source, a retrieved passage) is proposed
whole; text that does not is proposed nothing, and decodes as without speculation.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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

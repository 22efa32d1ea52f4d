"""When a speculating sequence drafts, on the host: the drafts themselves are made on the device
in the step that verifies them (`lookup`, or a draft model: see `steps.decode`), so the host
only says how many a sequence wants: by prompt lookup, only where the last step read found its
context's last tokens earlier (`steps.decode`'s `recurs`), and by either, none for a while after
verify steps that rejected all they proposed; and (`serve.speculative_auto`) only where a verify
step yields more tokens a second than a plain step would (`Pace`, `hold_back`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Many
from typing import Literal

from jaxllm.serve.scheduler import Sequence, State
from jaxllm.serve.settings import LONGEST_BACK_OFF, ServeConfig


def propose(sequence: Sequence, settings: ServeConfig, decoding: int) -> None:
    """Sets `sequence.drafts`, how many it wants the device to propose now (none if it does not
    speculate now, or if more than serve.speculative_max_batch of the engine's sequences, here
    `decoding`, decode), never past its max_tokens. It never waits for a step's tokens: the device
    proposes from the last token it drew, and moves a step back by the drafts that the steps
    before it rejected (`steps.decode`). Whether prompt lookup finds something is known a step
    late (the step after the one read is on its way), which costs little: a repeating passage
    goes on repeating, and a verify step that finds nothing runs as a plain step."""
    room = min(settings.draft_tokens, sequence.generation.request.max_tokens - sequence.issued - 1)
    now = sequence.state is State.DECODE and sequence.recurs and sequence.issued >= sequence.resume_at
    now &= not settings.speculative_max_batch or decoding <= settings.speculative_max_batch
    sequence.drafts = max(room, 0) if sequence.speculates and now else 0


def spaced_out(sequence: Sequence, proposed: int, accepted: int) -> None:
    """After a verify step is read back, in which the device proposed `proposed` tokens for the
    sequence and it kept `accepted`: one that kept none of a proposal proposes nothing for the next
    1, 2, 4, ... 32 tokens (misses in a row), decoding them as it would without speculation, as text
    that does not repeat decodes at plain decoding's pace."""
    if accepted:
        sequence.misses = 0
    elif proposed:
        sequence.resume_at = sequence.issued + min(2**sequence.misses, LONGEST_BACK_OFF)
        sequence.misses += 1


Kind = Literal["plain", "verify", "catch_up"]  # a catch-up: a verify step whose draft model reads back plain steps


class Pace:
    """What a decode step costs at each batch bucket, by kind (seconds, a moving average of the
    times between the reads of decode steps that follow one another), and what a verify step
    yields a row that proposed tokens (a moving average of its tokens, accepted and one)."""

    SMOOTHING = 0.2  # a step time's weight: the device's pace at a bucket moves little
    YIELD_SMOOTHING = 0.05  # a row's, from the 20th (the guess's among them): misses come in runs
    # The guess before the first verify step (every draft accepted) weighs as much as this many
    # rows: a first row's yield alone could stop verify steps, which then measure nothing.
    PRIOR_ROWS = 2
    # A kind of step not timed at a bucket where the other is (or before any bucket has both) is
    # tried at the first few decisions there, then at every 64th: a prefill beside every step
    # leaves it untimed, and a bucket whose nearest timed one says otherwise would never time it.
    FIRST_TRIES, TRY_EVERY = 4, 64

    def __init__(self, draft_tokens: int):
        self.seconds: dict[tuple[int, Kind], float] = {}  # (rows, kind) -> seconds a step
        self.yield_per_row = 1.0 + draft_tokens  # before the first verify step: all accepted
        self.rows_verified = self.PRIOR_ROWS
        self._seen: set[tuple[int, Kind]] = set()
        self._tries: dict[tuple[int, Kind], int] = {}  # decisions while that kind is untimed there

    def time(self, rows: int, kind: Kind, seconds: float) -> None:
        """A step's time; the first of each kind at each bucket is left out (a compiled step's first
        run pays one-off costs: a verify step's first took twice its usual time on a CPU)."""
        key = (rows, kind)
        if key not in self._seen:
            self._seen.add(key)
            return
        before = self.seconds.get(key, seconds)
        self.seconds[key] = before + self.SMOOTHING * (seconds - before)

    def yielded(self, tokens: int) -> None:
        """A row that proposed tokens kept `tokens` - 1 of them: the mean so far (the guess
        among them), then a moving average."""
        self.rows_verified += 1
        weight = max(1 / self.rows_verified, self.YIELD_SMOOTHING)
        self.yield_per_row += weight * (tokens - self.yield_per_row)

    def verify_pays(self, rows: int, plain_tokens: float, verify_tokens: float) -> bool:
        """Whether a verify step of `rows` yielding `verify_tokens` keeps up with a plain one
        yielding `plain_tokens`, by the times at the nearest batch bucket where both kinds are
        timed (with none, it is taken to: the engine verifies as it would without
        serve.speculative_auto). A catch-up's time is its own: it comes once in a run of verify
        steps. Now and then a kind untimed at `rows` is tried instead (`FIRST_TRIES`)."""
        timed = [r for r, kind in self.seconds if kind == "verify" and (r, "plain") in self.seconds]
        if (rows, "verify") in self.seconds or (rows, "plain") in self.seconds or not timed:
            untimed = "verify" if (rows, "verify") not in self.seconds else "plain"  # verify steps first
            if (rows, untimed) not in self.seconds:
                tried = self._tries[rows, untimed] = self._tries.get((rows, untimed), 0) + 1
                if tried <= self.FIRST_TRIES or tried % self.TRY_EVERY == 0:
                    return untimed == "verify"
        if not timed:
            return True
        nearest = min(timed, key=lambda r: abs(math.log2(r / rows)))
        return verify_tokens / self.seconds[nearest, "verify"] >= plain_tokens / self.seconds[nearest, "plain"]


def hold_back(decoding: Many[Sequence], pace: Pace, rows: int) -> bool:
    """Takes back the drafts `propose` set for the `decoding` sequences (a batch of bucket `rows`)
    where their verify step would yield fewer tokens a second than a plain step, by `pace`;
    whether it did. Where a sequence with drafts has not verified for `LONGEST_BACK_OFF` tokens,
    every sequence with drafts verifies: so acceptance is measured as the text changes, and a
    draft model reads back what plain steps decoded (`steps.decode`)."""
    wanting = [s for s in decoding if s.drafts]
    if not wanting or any(s.issued - s.verified_at >= LONGEST_BACK_OFF for s in wanting):
        return False
    if pace.verify_pays(rows, len(decoding), len(decoding) + len(wanting) * (pace.yield_per_row - 1)):
        return False
    for s in wanting:
        s.drafts = 0
    return True

"""When a speculating sequence drafts, on the host: the drafts themselves are made on the device
in the step that verifies them (`lookup`, or a draft model: see `steps.decode`), so the host
only says how many a sequence wants: by prompt lookup, only where the last step read found its
context's last tokens earlier (`steps.decode`'s `recurs`), and by either, none for a while after
verify steps that rejected all they proposed.
"""

from __future__ import annotations

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

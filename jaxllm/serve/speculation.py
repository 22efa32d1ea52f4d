"""Proposals for speculative decoding, on the host: prompt lookup ('ngram'). Where the context's
last n tokens occurred before (in the prompt or the output so far), the tokens that followed them
there are proposed to follow again, the longest n first and the latest occurrence of it; where
what followed runs into the present (a loop of a few tokens), the proposal goes on around it. Text
that repeats (code being edited, a summary quoting its source, a retrieved passage) is proposed
whole; text that does not is proposed nothing, and decodes as without speculation.

`propose` gives each speculating sequence its draft before a step (with a draft model, only its
length), and `back_off` spaces out a sequence's proposals while none of their tokens is accepted.
"""

from __future__ import annotations

from jaxllm.serve.scheduler import Sequence, State
from jaxllm.serve.settings import ServeConfig


class NgramIndex:
    """Where each run of n tokens (shortest <= n <= longest) of a sequence's prompt and output last
    began, kept up to date as its output arrives: a lookup reads a few dict entries and the new
    tokens, where a search would pass over the whole context for every n, so a sequence can look
    after every token it decodes."""

    def __init__(self, prompt: list[int], shortest: int, longest: int):
        self.shortest, self.longest = shortest, longest
        self.tokens, self.prompt_length = list(prompt), len(prompt)
        self.latest: dict[tuple[int, ...], int] = {}  # a run → where it last began, before the last token
        self.indexed = 0  # the runs ending at or before this index are in `latest`

    def lookup(self, output: list[int], count: int) -> list[int]:
        """`count` tokens that followed the latest earlier occurrence of the last n tokens of the
        prompt and `output` (which extends the last call's), for the largest n that has one (copied
        on from the proposal itself where they reach the end); [] if none has."""
        tokens = self.tokens
        tokens += output[len(tokens) - self.prompt_length :]
        for end in range(self.indexed + 1, len(tokens)):  # runs inside tokens[:-1]: earlier than the last n
            for n in range(self.shortest, min(self.longest, end) + 1):
                self.latest[tuple(tokens[end - n : end])] = end - n
        self.indexed = max(self.indexed, len(tokens) - 1)
        for n in range(min(self.longest, len(tokens) - 1), self.shortest - 1, -1):
            start = self.latest.get(tuple(tokens[-n:]))
            if start is not None:
                proposal, start = [], start + n
                for i in range(start, start + count):  # copied on from the proposal where it reaches the end
                    proposal.append(tokens[i] if i < len(tokens) else proposal[i - len(tokens)])
                return proposal
        return []


def propose(sequence: Sequence, settings: ServeConfig) -> None:
    """Sets `sequence.draft` (empty if it does not speculate now), never past its max_tokens; after
    a lookup that finds nothing the sequence decodes a token without waiting for a read and looks
    again. Prompt lookup does not wait for the token of a plain step
    still on the device: it proposes that token too, as it would any, and drafts the tokens after
    it. Verification keeps only the tokens the model would draw, whatever was proposed, so a draft
    after a wrong guess costs only speed. After a verify step (more than one token unread) prompt
    lookup waits, unless the last verify step read kept all its drafts: then it guesses that the
    one on the device keeps all of its too. A draft model, which drafts from the last token on the
    device, never waits. Either way the device moves a step back by the drafts that the steps
    before it rejected (`steps.decode`)."""
    s = settings
    sequence.draft = []
    unread = sequence.issued - len(sequence.output)
    waits = s.speculative == "ngram" and unread > 1 and not sequence.kept_all
    if not (sequence.speculates and sequence.state is State.DECODE) or waits:
        return
    room = min(s.draft_tokens, sequence.generation.request.max_tokens - sequence.issued - 1)
    if room <= 0 or sequence.issued < sequence.resume_at:
        return
    if s.speculative == "draft":
        sequence.draft = [0] * room  # how many: the draft model proposes them on the device
        return
    if sequence.lookups is None:
        sequence.lookups = NgramIndex(sequence.prompt, s.ngram_min, s.ngram_max)
    proposal = sequence.lookups.lookup(sequence.output, unread + room)
    sequence.draft = proposal[unread:]
    if not proposal:  # it looks again after its next token, which it decodes without waiting for a read
        sequence.resume_at = sequence.issued + 1


def back_off(sequence: Sequence) -> None:
    """After a proposal that had nothing accepted: propose nothing for the next
    1, 2, 4, ... 32 tokens (misses in a row), decoding them without waiting for each to be read,
    as text that does not repeat decodes at the pace it would without speculation."""
    sequence.resume_at = sequence.issued + 2 ** min(sequence.misses, 5)
    sequence.misses += 1

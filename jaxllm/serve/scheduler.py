"""Which sequences the engine's next step runs, and the pages they write into.

Each choice of a request is a `Sequence`. It waits in line, is admitted when a slot and the pages
for its prompt are free (sharing cached full pages of a prompt seen before), prefills in chunks
of at most the step's token budget (several short prompts in one chunk batch), then decodes one
token a step (and, speculating, its draft's tokens after it), taking a page whenever it crosses
into one; the pages of rejected draft tokens go back once the step is read. When no page is left for a decoding
sequence, the newest sequence is preempted: its pages go back to the pool and it waits at the
head of the line, to prefill its prompt and output so far again (recompute, as vLLM does) and go
on where it stopped; its draws depend only on the request's seed and the token's index, so its
output is the same. A request's later choices wait for the first's prefill, so with the prefix
cache on they share its prompt's full pages instead of computing them again.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time
from typing import Any

from jaxllm.serve.buckets import Buckets
from jaxllm.serve.generation import Generation
from jaxllm.serve.pages import PagePool


class State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclasses.dataclass(eq=False)
class Sequence:
    generation: Generation
    choice: int
    first: Sequence | None = None  # the request's first choice, when this is a later one
    state: State = State.WAITING
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    target: list[int] = dataclasses.field(default_factory=list)  # what the prefill reads
    computed: int = 0  # target tokens whose keys and values are in the pages (or on their way)
    issued: int = 0  # output tokens dispatched, read back or not (a verify step's drafts counted until read)
    rejected: int = 0  # drafts its verify steps rejected, read back since its prefill
    scores_prompt: bool = False  # its first prefill computes each prompt token's log-prob, so reads every one
    scored: Any = None  # those log-probs (`Tokens`), as its chunks come back
    speculates: bool = False  # drafts tokens for its next steps (see `speculation`)
    drafts: int = 0  # tokens the device is to propose after its next one, in the step being planned
    recurs: bool = True  # (prompt lookup) the device finds a proposal after its last token read back
    resume_at: int = 0  # a speculating sequence proposes nothing before this output index ...
    misses: int = 0  # ... after this many verify steps in a row rejected all they proposed
    verified_at: int = 0  # `issued` when it last fed a verify step its drafts, or finished its prefill
    behind: bool = False  # took plain steps since: its next verify step's draft model reads them back

    @property
    def prompt(self) -> list[int]:
        return self.generation.request.prompt

    @property
    def position(self) -> int:
        """Where the token this sequence feeds next goes."""
        return len(self.prompt) + self.issued - 1

    @property
    def dispatched(self) -> int:
        """Output tokens and drafts dispatched since its prefill (and its output before): reads
        move drafts from `issued` to `rejected` and leave this as it is, so a step's rows record it
        to tell whether the tokens they draw follow the sequence's output when they are read."""
        return self.issued + self.rejected

    @property
    def output(self) -> list[int]:
        """The output tokens read back so far."""
        return self.generation.streams[self.choice].tokens

    def wants_tokens(self) -> bool:
        """Decoding, short of max_tokens, and (if constrained: its grammar's mask follows from its
        last token) with every token read back. A speculating sequence does not wait: its drafts
        are made on the device (see `speculation`)."""
        synced = self.issued == len(self.output)
        ready = synced or not self.generation.matchers
        return self.state is State.DECODE and self.issued < self.generation.request.max_tokens and ready


@dataclasses.dataclass(frozen=True)
class Chunk:
    sequence: Sequence
    start: int
    count: int

    @property
    def final(self) -> bool:
        return self.start + self.count == len(self.sequence.target)

    @property
    def tokens(self) -> list[int]:
        return self.sequence.target[self.start : self.start + self.count]


@dataclasses.dataclass(frozen=True)
class Plan:
    decode: list[Sequence]
    prefill: list[Chunk]


class Scheduler:
    def __init__(self, pool: PagePool, slots: int, buckets: Buckets):
        self.pool, self.buckets = pool, buckets
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # prefilling or decoding, oldest first; each holds a slot
        self._free_slots = list(range(slots))[::-1]
        self.preemptions = 0
        self.prefix_hits = self.prefix_misses = 0  # full prompt pages found, and not, in the prefix cache

    def add(self, generation: Generation, prompt_logprobs: bool) -> list[Sequence]:
        """Queues a request's choices; with `prompt_logprobs`, its first prefills every prompt token."""
        first = Sequence(generation, 0, scores_prompt=prompt_logprobs)
        later = [Sequence(generation, c, first) for c in range(1, generation.request.n)]
        self.waiting.extend([first, *later])
        return [first, *later]

    def plan(self) -> Plan:
        """The next step: a token for every decoding sequence that wants one (preempting the
        newest while pages run out), then admissions, then a chunk batch of prefill work."""
        decode = self._grow()
        self._admit()
        return Plan(decode, self._chunks())

    def advance(self, chunk: Chunk) -> None:
        """After `chunk` was dispatched: a final chunk's sequence decodes from now on, and its
        full pages join the prefix cache."""
        sequence = chunk.sequence
        sequence.computed += chunk.count
        if chunk.final:
            sequence.state, sequence.issued = State.DECODE, sequence.issued + 1
            self.pool.remember(sequence.target, sequence.pages)

    def finish(self, sequence: Sequence) -> None:
        """The sequence has ended (or its request has): its pages and slot go back."""
        if sequence.state is State.WAITING:
            self.waiting.remove(sequence)
        elif sequence.state is not State.DONE:
            self._let_go(sequence)
        sequence.state = State.DONE

    def trim(self, sequence: Sequence) -> None:
        """Gives back the pages past a sequence's next position (taken for rejected draft tokens)."""
        keep = self.pool.pages_for(sequence.position + 1)
        self.pool.release(sequence.pages[keep:])
        del sequence.pages[keep:]

    def _let_go(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self.pool.release(sequence.pages)
        self._free_slots.append(sequence.slot)
        sequence.pages, sequence.slot = [], None

    def _preempt(self, sequence: Sequence) -> None:
        self._let_go(sequence)
        sequence.state, sequence.computed = State.WAITING, 0
        self.waiting.appendleft(sequence)
        self.preemptions += 1

    def _grow(self) -> list[Sequence]:
        for sequence in list(self.running):
            last = sequence.position + sequence.drafts  # where the step's last token goes
            while sequence.wants_tokens() and len(sequence.pages) < self.pool.pages_for(last + 1):
                if taken := self.pool.take(1):
                    sequence.pages += taken
                else:
                    self._preempt(self.running[-1])
        return [s for s in self.running if s.wants_tokens()]

    def _admit(self) -> None:
        """First come, first served, while a slot and the pages for the next prompt are free. A
        preempted sequence waits until its last dispatched token has been read back."""
        while self.waiting and self._free_slots:
            sequence = self.waiting[0]
            if sequence.issued > len(sequence.output):
                return
            if sequence.first is not None and sequence.first.state in (State.WAITING, State.PREFILL):
                if self.pool.prefix_cache:
                    return  # the first choice's prompt pages will be there to share
            target = sequence.prompt + sequence.output
            shares = self.pool.prefix_cache and not (sequence.scores_prompt and target == sequence.prompt)
            shared = self.pool.share(target) if shares else []
            fresh = self.pool.take(self.pool.pages_for(len(target) + 1) - len(shared))
            if fresh is None:
                self.pool.release(shared)
                return
            if shares:
                self.prefix_hits += len(shared)
                self.prefix_misses += (len(target) - 1) // self.pool.page_size - len(shared)
            self.waiting.popleft()
            generation = sequence.generation
            generation.scheduled_at = generation.scheduled_at or time.perf_counter()
            sequence.state, sequence.slot, sequence.pages = State.PREFILL, self._free_slots.pop(), shared + fresh
            sequence.target, sequence.computed = target, len(shared) * self.pool.page_size
            sequence.issued, sequence.rejected = len(sequence.output), 0
            self.running.append(sequence)

    def _chunks(self) -> list[Chunk]:
        """The prefill work of one step: the oldest prefilling sequence's next piece (at most the
        token budget), and beside it as many others as fit the budget at that piece's bucket length."""
        pending = [s for s in self.running if s.state is State.PREFILL]
        if not pending:
            return []
        head = pending[0]
        size = Buckets.fit(min(len(head.target) - head.computed, self.buckets.budget), self.buckets.chunks)
        rows = pending[: self.buckets.prefill_rows(size)[-1]]
        return [Chunk(s, s.computed, min(len(s.target) - s.computed, size)) for s in rows]

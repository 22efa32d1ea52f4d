"""The serving engine's host side: requests in, tokens and text out, over a paged KV cache that a
`Runner` (see `runner`) keeps on the devices. Nothing here needs JAX: a fake runner stands in for
the device in tests of the scheduling and the HTTP layer.

Each `step()` plans with the `Scheduler` (a token for every decoding sequence, admissions by free
pages, a chunk batch of prefill work), dispatches a decode batch and a prefill batch for it, and
only then reads back the previous step's tokens and streams them (text, stop strings,
log-probs): the device runs the new step while the host does that work. A sequence that ended
in the step just read costs one discarded token in the step already dispatched. A constrained
sequence (a structured output) waits for its last token to be read before it decodes again, as
its grammar's mask for the next token depends on it: it decodes every other step, and its mask
is computed while the device runs the step between. A speculating sequence (`serve.speculative`)
feeds its next token and a draft after it, and streams as many tokens as the model accepts, and
one more. It never waits for a step's tokens: the device makes its drafts (by prompt lookup or a
draft model) and knows where a verify step left it (see `speculation.propose`).
`serve_forever()` steps in a thread of its
own while other threads (or an event loop) submit and read.

A request can fail only itself: whatever serving one request raises (its admission, sampling
settings, grammar, stop strings or text) ends that request alone, and a request past its
deadline (`serve.request_timeout_s`) ends with an error and frees its pages. Only a failed device
step, which every running sequence shares, ends the running requests: the runner then rebuilds its
cache and the engine serves on, up to `serve.max_engine_restarts` failed steps in a row.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.serve.batches import DecodeBatch, PrefillBatch, PrefillRow, decode_batch, prefill_batch
from jaxllm.serve.buckets import Buckets
from jaxllm.serve.constraints import mask_words
from jaxllm.serve.generation import Generation, Limits, Logprob, Request, RequestFailed, Tokens, Unavailable
from jaxllm.serve.guards import PerplexityAlarm
from jaxllm.serve.pages import PagePool
from jaxllm.serve.scheduler import Chunk, Plan, Scheduler, Sequence, State
from jaxllm.serve.settings import ServeConfig
from jaxllm.serve.speculation import Pace, hold_back, propose, spaced_out

log = logging.getLogger("jaxllm.serve")


class Device(Protocol):
    """What the engine needs of the device side (`runner.Runner`, or a test's fake)."""

    def decode(self, batch: DecodeBatch) -> Any: ...

    def prefill(self, batch: PrefillBatch) -> Any: ...

    def read(self, pending: Any) -> tuple[Tokens, Tokens | None]: ...

    def reset(self) -> None: ...

    def decode_bytes(self, contexts: list[int]) -> float: ...

    bandwidth: float  # bytes/s one device's memory streams


@dataclasses.dataclass
class Dispatched:
    """A step on its way: its outputs (the device's, until read), the rows that draw a token,
    (from a prefill that scores prompts) the rows whose prompt tokens it scored, and (from a
    decode) the bytes each device reads in it."""

    pending: Any
    draws: list[tuple[int, Sequence, int]]  # (row, sequence, its `dispatched` count then)
    scored: list[tuple[int, Chunk]] = dataclasses.field(default_factory=list)
    decode_bytes: float = 0.0
    drafted: list[int] = dataclasses.field(default_factory=list)  # each row's draft tokens
    rows: int = 0  # (a decode) its batch bucket
    at: int = 0  # (a decode) the engine step that dispatched it
    after_prefill: bool = False  # (a decode) whether the engine step before dispatched a prefill
    catches_up: bool = False  # (a decode) a row's draft model reads back plain steps' tokens (`Sequence.behind`)


@dataclasses.dataclass(frozen=True)
class Stats:
    """The engine now, for the server's metrics."""

    queued: int  # requests none of whose choices has started
    active_slots: int
    cache_usage: float  # the fraction of the KV cache's pages that sequences hold
    cached_pages: int  # pages in the prefix cache, held or idle
    prefix_hits: int  # full prompt pages found in the prefix cache since start
    prefix_misses: int
    page_size: int
    preemptions: int
    restarts: int  # caches rebuilt after a failed step
    bandwidth_use: float  # of one device's memory bandwidth, over recent decode steps (0 before any)
    drafts: int  # drafts verified since start (one per sequence and step)
    draft_tokens: int  # tokens they proposed
    accepted_tokens: int  # of those, the tokens the model accepted
    held_back: int  # decode steps whose drafts serve.speculative_auto took back (see `speculation.hold_back`)


class Engine:
    """Serves requests with `device` (see `Device`), as `settings` say, each request within
    `limits`; `alarm` judges prompts once scored (`serve.prompt_nll`)."""

    BANDWIDTH_SMOOTHING = 0.1  # the weight of each decode step in the bandwidth gauge's moving average

    def __init__(
        self,
        device: Device,
        settings: ServeConfig,
        limits: Limits,
        tokenizer: Tokenizer,
        alarm: PerplexityAlarm | None = None,
        salt: str = "",
    ):
        self.device, self.settings, self.limits, self.tokenizer, self.alarm = device, settings, limits, tokenizer, alarm
        s = settings
        self.slots, self.max_len, self.vocab_size = s.slots, s.max_len, limits.vocab_size
        self.words = mask_words(tokenizer.vocab_size)
        self.buckets = Buckets.of(s.slots, s.max_len, s.page_size, s.prefill_chunk)
        self.pool = PagePool(s.kv_pages, s.page_size, salt, s.prefix_cache)  # `salt`: shared by one model and dtype
        self.scheduler = Scheduler(self.pool, s.slots, self.buckets)
        self._incoming: list[Generation] = []  # submitted, not yet seen by the engine thread
        self._sequences: dict[Generation, list[Sequence]] = {}
        self._dispatched: list[Dispatched] = []  # steps whose tokens the host has not read yet
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set by submit, for serve_forever
        self._queued = 0  # requests none of whose choices has started
        self.failure: BaseException | None = None  # why the engine stopped, if it did
        self.restarts = 0  # caches rebuilt after a failed step
        self._failed_in_a_row = 0
        self.steps_run = 0
        self.profiler = None  # with `before(step)` and `after(step, pending)`: traces steps A..B (--profile-steps)
        self._bandwidth_use, self._last_decode_read = 0.0, None  # (when, the step read's `at`)
        self._prefilled = False  # whether the last engine step dispatched a prefill (read by `_dispatch_decode`)
        self.pace = Pace(s.draft_tokens)
        self.drafts = self.draft_tokens = self.accepted_tokens = self.held_back = 0  # speculative decoding's totals
        self.clock = time.perf_counter  # times decode steps, for the bandwidth gauge and `pace`

    def submit(
        self, request: Request, loop: asyncio.AbstractEventLoop | None = None, request_id: str | None = None
    ) -> Generation:
        """Queues a request (from any thread; with `loop`, read it with `async for` there), under
        `request_id` in the log if given. Raises `RequestError` if it cannot be served,
        `Unavailable` if the queue is full or the engine has stopped."""
        self.limits.check(request)
        s = self.settings
        generation = Generation(request, self.tokenizer, time.monotonic() + s.request_timeout_s, loop, request_id)
        with self._lock:
            if self.failure is not None:
                raise Unavailable(f"the engine has stopped: {self.failure!r}")
            free = self.slots - len(self.scheduler.running)  # the free slots take some now
            if len(self._incoming) + self._queued >= s.max_queue + free:
                raise Unavailable(f"all {s.max_queue} queue places are taken (serve.max_queue)")
            self._incoming.append(generation)
        self._wake.set()
        return generation

    def generate(self, requests: list[Request]) -> list[Generation]:
        """Submits `requests` and steps until all have ended (each has a deadline)."""
        generations = [self.submit(r) for r in requests]
        while self.busy():
            self.step()
        return generations

    def busy(self) -> bool:
        return bool(self._incoming or self._sequences or self._dispatched)

    def queued(self) -> int:
        return len(self._incoming) + self._queued

    def stats(self) -> Stats:
        return Stats(
            self.queued(), len(self.scheduler.running), self.pool.in_use() / self.pool.capacity, self.pool.cached(),
            self.scheduler.prefix_hits, self.scheduler.prefix_misses, self.pool.page_size, self.scheduler.preemptions,
            self.restarts, self._bandwidth_use, self.drafts, self.draft_tokens, self.accepted_tokens, self.held_back,
        )  # fmt: skip

    def serve_forever(self, stop: threading.Event, on_step: Callable[[int], None] = lambda rows: None) -> None:
        """Steps whenever there is work until `stop` is set, calling `on_step` with each decode
        step's rows. If the engine stops (more failed steps in a row than
        `serve.max_engine_restarts`), every request ends with the error, new ones are refused
        (`Unavailable`), and the error is raised."""
        try:
            while not stop.is_set():
                if not self.busy():
                    self._wake.wait(0.1)
                    self._wake.clear()
                elif rows := self.step():
                    on_step(rows)
        except BaseException as failure:
            self._stop(failure)
            raise

    def step(self) -> int:
        """Plans and dispatches the next step, then reads back the one before; returns how many
        sequences the dispatched decode step advances. Steps count from 1 (for `profiler`)."""
        self.steps_run += 1
        if self.profiler is None:
            return self._step()
        self.profiler.before(self.steps_run)
        rows = self._step()
        self.profiler.after(self.steps_run, [d.pending for d in self._dispatched])
        return rows

    def _step(self) -> int:
        self._take_incoming()
        self._drop_ended()
        plan = self._plan()
        dispatched = []
        try:
            if not (plan.decode or plan.prefill) and self._dispatched:
                # Every sequence waits for a step on the device (a constrained one's token): read
                # it now, and dispatch what follows from it in this step rather than the next.
                previous, self._dispatched = self._dispatched, []
                for step in previous:
                    self._read(step)
                self._last_decode_read = None  # the device idles while the host plans: time no step from here
                plan = self._plan()
            if plan.decode and (step := self._dispatch_decode(plan.decode)):
                dispatched.append(step)
            self._prefilled = False
            if plan.prefill and (step := self._dispatch_prefill(plan.prefill)):
                dispatched.append(step)
                self._prefilled = True
            previous, self._dispatched = self._dispatched, dispatched
            for step in previous:
                self._read(step)
        except Exception as failure:
            self._restart(failure)
            return 0
        self._failed_in_a_row = 0
        return len(plan.decode)

    def _plan(self) -> Plan:
        decoding = [s for s in self.scheduler.running if s.state is State.DECODE]
        for sequence in self.scheduler.running:
            propose(sequence, self.settings, len(decoding))
        if self.settings.speculative_auto:
            self.held_back += hold_back(decoding, self.pace, Buckets.fit(max(len(decoding), 1), self.buckets.rows))
        plan = self.scheduler.plan()
        self._queued = len({s.generation for s in self.scheduler.waiting if s.issued == 0 and s.choice == 0})
        return plan

    def _take_incoming(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
        for generation in incoming:
            self._sequences[generation] = self.scheduler.add(generation, self.settings.prompt_nll)
            for sequence in self._sequences[generation]:  # a grammar's mask is for one token at a time
                sequence.speculates = self.settings.speculative != "off" and not generation.matchers

    def _drop_ended(self) -> None:
        """Requests whose client went away, or past their deadline, end and free their pages."""
        now = time.monotonic()
        for generation in list(self._sequences):
            if generation.cancelled or now >= generation.deadline:
                self._drop(generation, None if generation.cancelled else self._late(generation))

    def _dispatch_decode(self, sequences: list[Sequence]) -> Dispatched | None:
        masks = {}
        for s in sequences:
            if s.generation.matchers:
                with self._serving(s.generation):
                    masks[s] = self._mask(s)
        sequences = [s for s in sequences if s.state is State.DECODE]  # not failed meanwhile
        if not sequences:
            return None
        width = Buckets.fit(max(len(s.pages) for s in sequences), self.buckets.pages)
        rows = Buckets.fit(len(sequences), self.buckets.rows)
        drafts = self.settings.draft_tokens if any(s.drafts for s in sequences) else 0
        pending = self.device.decode(decode_batch(sequences, masks, rows, width, self.slots, self.words, drafts))
        draws = [(row, s, s.dispatched) for row, s in enumerate(sequences)]
        decode_bytes = self.device.decode_bytes([s.position + 1 for s in sequences])
        catches_up = self.settings.speculative == "draft" and any(s.drafts and s.behind for s in sequences)
        for s in sequences:
            if s.drafts:
                s.verified_at = s.issued
            s.behind = not s.drafts
            s.issued += 1 + s.drafts
        return Dispatched(
            pending, draws, decode_bytes=decode_bytes, drafted=[s.drafts for s in sequences], rows=rows,
            at=self.steps_run, after_prefill=self._prefilled, catches_up=catches_up,
        )  # fmt: skip

    def _mask(self, sequence: Sequence) -> np.ndarray:
        """The tokens a constrained sequence may draw next, as a bitmask row."""
        row = np.empty(self.words, np.int32)
        sequence.generation.allowed(sequence.choice, row)
        return row

    def _prefill_row(self, chunk: Chunk) -> PrefillRow:
        constrained = chunk.final and chunk.sequence.generation.matchers
        return PrefillRow.of(chunk, self._mask(chunk.sequence) if constrained else None)

    def _dispatch_prefill(self, chunks: list[Chunk]) -> Dispatched | None:
        rows = {}
        for chunk in chunks:
            with self._serving(chunk.sequence.generation):
                rows[chunk] = self._prefill_row(chunk)
        chunks = [c for c in chunks if c in rows and c.sequence.state is State.PREFILL]  # not failed meanwhile
        if not chunks:
            return None
        size = Buckets.fit(max(c.count for c in chunks), self.buckets.chunks)
        width = Buckets.fit(max(len(c.sequence.pages) for c in chunks), self.buckets.pages)
        count = Buckets.fit(len(chunks), self.buckets.prefill_rows(size))
        batch = prefill_batch([rows[c] for c in chunks], count, size, width, self.slots, self.words)
        pending = self.device.prefill(batch)
        draws = [(row, c.sequence, c.sequence.dispatched) for row, c in enumerate(chunks) if c.final]
        scored = [(row, c) for row, c in enumerate(chunks) if c.sequence.scores_prompt and not c.sequence.output]
        for chunk in chunks:
            self.scheduler.advance(chunk)
            chunk.sequence.verified_at, chunk.sequence.behind = chunk.sequence.issued, False  # the draft holds it all
        return Dispatched(pending, draws, scored if self.settings.prompt_nll else [])

    def _read(self, step: Dispatched) -> None:
        """Streams what `step` produced; a choice that finishes gives back its pages and slot."""
        tokens, prompt, recurs = self.device.read(step.pending)
        if step.decode_bytes:
            self._time_decode(step, tokens)
        if step.scored:
            self._score_prompts(step.scored, prompt)
        for row, sequence, dispatched in step.draws:
            generation = sequence.generation
            if sequence.state is State.DONE or dispatched != len(sequence.output) + sequence.rejected:
                continue  # it ended after the step was dispatched
            if recurs is not None:
                sequence.recurs = bool(recurs[row])
            with self._serving(generation):
                if tokens.ids.ndim == 1:
                    logprob = self._logprob(generation, tokens, row)
                    finished = generation._push(sequence.choice, int(tokens.ids[row]), logprob)
                else:
                    finished = self._push_verified(sequence, Tokens(*(a[row] for a in tokens)), step.drafted[row])
                if finished:
                    self.scheduler.finish(sequence)
                    if generation.done:
                        del self._sequences[generation]

    def _push_verified(self, sequence: Sequence, tokens: Tokens, drafted: int) -> bool:
        """Streams a verify step's row (its accepted draft tokens and the one after, then -2 for each
        draft it rejected, -1 past them); True once the sequence has finished. Otherwise the pages
        taken for rejected tokens go back."""
        row = tokens.ids.tolist()
        ids = [t for t in row if t >= 0]
        proposed = sum(t != -1 for t in row) - 1  # accepted, then -2 for each rejected
        if proposed:
            self.drafts, self.draft_tokens, self.accepted_tokens = (
                self.drafts + 1, self.draft_tokens + proposed, self.accepted_tokens + len(ids) - 1,
            )  # fmt: skip
            self.pace.yielded(len(ids))
        generation = sequence.generation
        for j, token in enumerate(ids):
            if generation._push(sequence.choice, token, self._logprob(generation, tokens, j)):
                return True
        rejected = drafted - (len(ids) - 1)  # (a row may have later steps on their way, which the device corrects)
        sequence.issued, sequence.rejected = sequence.issued - rejected, sequence.rejected + rejected
        self.scheduler.trim(sequence)
        spaced_out(sequence, proposed, len(ids) - 1)
        return False

    def _time_decode(self, step: Dispatched, tokens: Tokens) -> None:
        """The time since the last decode step's read: the device's pace while decode steps follow
        one another. Over it, the bytes the step read (the bandwidth gauge); and where the decode
        before it was dispatched in the engine step before, with no prefill after it, the step's
        cost for `pace`: verifying where a row holds a token or a rejection after its first, a
        catch-up where a draft model also read back plain steps' tokens."""
        now, last = self.clock(), self._last_decode_read
        self._last_decode_read = now, step.at
        if last is None or now <= last[0]:
            return
        use = step.decode_bytes / (now - last[0]) / self.device.bandwidth
        self._bandwidth_use += self.BANDWIDTH_SMOOTHING * (use - self._bandwidth_use)
        if last[1] == step.at - 1 and not step.after_prefill:
            verified = tokens.ids.ndim == 2 and bool((tokens.ids[:, 1:] != -1).any())
            kind = ("catch_up" if step.catches_up else "verify") if verified else "plain"
            self.pace.time(step.rows, kind, now - last[0])

    def _score_prompts(self, scored: list[tuple[int, Chunk]], prompt: Tokens) -> None:
        """Collects each prompt token's log-prob from the prefill chunks that read it; once a
        prompt is whole, its perplexity, and the alarm's verdict."""
        for row, chunk in scored:
            sequence = chunk.sequence
            if sequence.state is State.DONE:
                continue
            with self._serving(sequence.generation):
                length = len(sequence.prompt) - 1
                if sequence.scored is None:
                    sequence.scored = Tokens(*(np.zeros((length, *a.shape[2:]), a.dtype) for a in prompt))
                count = max(0, min(chunk.count, length - chunk.start))
                for whole, part in zip(sequence.scored, prompt, strict=True):
                    whole[chunk.start : chunk.start + count] = part[row, :count]
                if chunk.final:
                    self._judge(sequence.generation, sequence.scored)

    def _judge(self, generation: Generation, scored: Tokens) -> None:
        """Records the prompt's log-probs, and ends the request if the perplexity alarm refuses it."""
        generation.prompt_logprobs = scored
        if self.alarm is not None and (refusal := self.alarm.judge(generation, -scored.logprobs)):
            self._drop(generation, refusal)

    @contextlib.contextmanager
    def _serving(self, generation: Generation) -> Iterator[None]:
        """Whatever serving `generation` raises ends it alone, logged with its traceback."""
        try:
            yield
        except Exception as e:
            log.exception("request %s failed in the engine; the engine serves on", generation.id)
            message = f"request {generation.id} failed in the engine ({type(e).__name__}); the server's log has why"
            self._drop(generation, RequestFailed(message, "internal_error"))

    def _drop(self, generation: Generation, error: Exception | None) -> None:
        """Ends `generation` (with `error`, if any) and frees its pages and slots."""
        for sequence in self._sequences.pop(generation, []):
            self.scheduler.finish(sequence)
        generation._end(error)

    def _late(self, generation: Generation) -> RequestFailed:
        timeout = self.settings.request_timeout_s
        message = (f"request {generation.id} ran past its deadline of {timeout:g} s (serve.request_timeout_s) and was "
                   "stopped; ask for fewer tokens, or retry when the server is less busy")  # fmt: skip
        return RequestFailed(message, "timeout")

    def _restart(self, failure: Exception) -> None:
        """A failed device step: the requests with sequences running (their keys and values are
        lost) end with the error, and the cache is rebuilt; past `serve.max_engine_restarts`
        failures in a row, the engine stops."""
        self._failed_in_a_row += 1
        if self._failed_in_a_row > self.settings.max_engine_restarts:
            self._stop(failure)
            raise failure
        log.exception("a device step failed; rebuilding the KV cache (restart %d)", self.restarts + 1)
        self._dispatched = []
        for generation in {s.generation for s in self.scheduler.running}:
            message = (f"request {generation.id} was lost when a device step failed ({type(failure).__name__}) "
                       "and the engine restarted; retry it")  # fmt: skip
            self._drop(generation, RequestFailed(message, "internal_error"))
        for sequences in self._sequences.values():  # preempted ones prefill again from the start
            for s in sequences:
                s.issued = len(s.output)
        self.pool.forget()
        self.device.reset()
        self.restarts += 1

    def _stop(self, failure: BaseException) -> None:
        """Stops for good: every request ends with `Unavailable`, and new ones are refused."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure, incoming = failure, self._incoming
            self._incoming = []
        stopped = Unavailable(f"the engine has stopped: {failure!r}")
        for generation in [*incoming, *self._sequences]:
            self._drop(generation, stopped)
        self._dispatched = []

    @staticmethod
    def _logprob(generation: Generation, tokens, row: int) -> Logprob | None:
        top = generation.request.logprobs
        if top is None:
            return None
        alternatives = zip(tokens.top_ids[row, :top].tolist(), tokens.top_logprobs[row, :top].tolist(), strict=True)
        return Logprob(int(tokens.ids[row]), float(tokens.logprobs[row]), list(alternatives))

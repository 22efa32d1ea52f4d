"""The serving engine: requests in, tokens and text out, over a paged KV cache.

Each `step()` plans with the `Scheduler` (a token for every decoding sequence, admissions by free
pages, a chunk batch of prefill work), dispatches a decode step and a prefill step for it, and
only then reads back the previous step's tokens and streams them (text, stop strings,
log-probs): the device runs the new step while the host does that work. A sequence that ended
in the step just read costs one discarded token in the step already dispatched. Every device
step, each bucket of rows, table width and chunk length (see `steps.Buckets`), is compiled when
the engine starts, so no request waits for a compile. `serve_forever()` steps in a thread of
its own while other threads (or an event loop) submit and read.

A request can fail only itself: whatever serving one request raises (its admission, sampling
settings, stop strings or text) ends that request alone, and a request past its deadline
(`serve.request_timeout_s`) ends with an error and frees its pages. Only a failed device step,
which every running sequence shares, ends the running requests: the engine then rebuilds its
cache and serves on, up to `serve.max_engine_restarts` failed steps in a row.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.model.cache import AXES, SCRATCH_PAGE, KVCache
from jaxllm.model.decoder import Model
from jaxllm.model.sampling import Sampling
from jaxllm.parallel.rules import logical_spec
from jaxllm.profile import StepProfiler
from jaxllm.serve.generation import Generation, Limits, Logprob, Request, RequestError, RequestFailed, Unavailable
from jaxllm.serve.guards import prompt_perplexity
from jaxllm.serve.pages import PagePool
from jaxllm.serve.scheduler import Chunk, Scheduler, Sequence, State
from jaxllm.serve.settings import Serving
from jaxllm.serve.steps import Buckets, Slots, Tokens, decode, prefill

log = logging.getLogger("jaxllm.serve")


@dataclasses.dataclass
class Dispatched:
    """A step on its way: its outputs (device arrays), the rows that draw a token, and (from a
    prefill that scores prompts) the rows whose prompt tokens it scored."""

    tokens: Tokens
    draws: list[tuple[int, Sequence, int]]  # (row, sequence, index of the output token drawn)
    scored: list[tuple[int, Chunk]] = dataclasses.field(default_factory=list)
    prompt: Tokens | None = None


class Engine:
    """Serves `params` (in `mesh`'s shardings) of `serving.model` as `serving.settings` say (see
    `serve.settings.serving_config`)."""

    def __init__(self, params: dict, serving: Serving, tokenizer: Tokenizer, mesh: Mesh):
        self.params, self.tokenizer, self.mesh = params, tokenizer, mesh
        self.settings = s = serving.settings
        self.model = Model(serving.model)  # built once: every step below binds its graph to the params
        self.limits = Limits.of(serving, tokenizer)
        self.slots, self.max_len, self.vocab_size = s.slots, s.max_len, self.limits.vocab_size
        self.buckets = Buckets.of(s.slots, s.max_len, s.page_size, s.prefill_chunk)
        salt = f"{serving.model}|{s.dtype}|{s.kv_dtype}"  # pages are shared only within one model and dtype
        self.pool = PagePool(s.kv_pages, s.page_size, salt, s.prefix_cache)
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
        self.profiler: StepProfiler | None = None  # traces engine steps A..B when set (--profile-steps)
        with jax.set_mesh(mesh):
            pool = NamedSharding(mesh, logical_spec(AXES))  # an int8 cache's scales too (their head_dim is 1)
            self._shardings = (pool, NamedSharding(mesh, P()))
            self._reset()
            self._compile()

    def _reset(self) -> None:
        """A zero cache and slot state on the devices."""
        cache = KVCache.paged(
            self.model.config, self.settings.kv_pages, self.settings.page_size, self.settings.kv_dtype
        )
        pool, replicated = self._shardings
        self.pools = jax.device_put((cache.keys, cache.values), pool)
        self.slots_state = jax.device_put(Slots.empty(self.slots), replicated)

    def _compile(self) -> None:
        """Every step the engine will run, compiled now, each with its outputs' shardings fixed and
        the cache and slot state donated: a decode step per (rows, table width) bucket, a prefill
        step per (rows, chunk length, table width) bucket."""
        b, pool, replicated = self.buckets, *self._shardings
        out = ((pool, pool), replicated)
        common = dict(model=self.model, vocab_size=self.vocab_size)
        decode_step = jax.jit(partial(decode, **common), out_shardings=(*out, replicated), donate_argnums=(1, 2))
        prefill_step = partial(prefill, logprobs=self.settings.prompt_nll, **common)
        prefill_step = jax.jit(prefill_step, out_shardings=(*out, replicated, replicated), donate_argnums=(1, 2))
        state = (self.pools, self.slots_state)
        self.decode_steps, self.prefill_steps = {}, {}  # compiled, by (rows, pages) and (rows, chunk, pages)
        for width in b.pages:
            for rows in b.rows:
                args = self._decode_args([], rows, width)
                self.decode_steps[rows, width] = decode_step.lower(self.params, *state, *args).compile()
            for chunk in (c for c in b.chunks if width * self.settings.page_size >= c):
                for rows in b.prefill_rows(chunk):
                    args = self._prefill_args([], rows, chunk, width)
                    self.prefill_steps[rows, chunk, width] = prefill_step.lower(self.params, *state, *args).compile()

    def decode_step(self, *args):
        """Dispatches a compiled decode step (its bucket from the arguments' shapes)."""
        rows, table = args[0], args[3]
        return self.decode_steps[len(rows), table.shape[1]](self.params, self.pools, self.slots_state, *args)

    def prefill_step(self, *args):
        """Dispatches a compiled prefill step (its bucket from the arguments' shapes)."""
        tokens, table = args[1], args[4]
        step = self.prefill_steps[(*tokens.shape, table.shape[1])]
        return step(self.params, self.pools, self.slots_state, *args)

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

    def active_slots(self) -> int:
        return len(self.scheduler.running)

    def cache_usage(self) -> float:
        """The fraction of the KV cache's pages that sequences hold."""
        return self.pool.in_use() / self.pool.capacity

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
        self.profiler.after(self.steps_run, [d.tokens for d in self._dispatched])
        return rows

    def _step(self) -> int:
        self._take_incoming()
        self._drop_ended()
        plan = self.scheduler.plan()
        self._queued = len({s.generation for s in self.scheduler.waiting if s.issued == 0 and s.choice == 0})
        dispatched = []
        try:
            if plan.decode:
                dispatched.append(self._dispatch_decode(plan.decode))
            if plan.prefill and (step := self._dispatch_prefill(plan.prefill)):
                dispatched.append(step)
            previous, self._dispatched = self._dispatched, dispatched
            for step in previous:
                self._read(step)
        except Exception as failure:
            self._restart(failure)
            return 0
        self._failed_in_a_row = 0
        return len(plan.decode)

    def _take_incoming(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
        for generation in incoming:
            self._sequences[generation] = self.scheduler.add(generation, self.settings.prompt_nll)

    def _drop_ended(self) -> None:
        """Requests whose client went away, or past their deadline, end and free their pages."""
        now = time.monotonic()
        for generation in list(self._sequences):
            if generation.cancelled or now >= generation.deadline:
                self._drop(generation, None if generation.cancelled else self._late(generation))

    def _dispatch_decode(self, sequences: list[Sequence]) -> Dispatched:
        width = Buckets.fit(max(len(s.pages) for s in sequences), self.buckets.pages)
        *args, _ = self._decode_args(sequences, Buckets.fit(len(sequences), self.buckets.rows), width)
        logprobs = any(s.generation.request.logprobs is not None for s in sequences)
        self.pools, self.slots_state, tokens = self.decode_step(*args, np.bool_(logprobs))
        draws = [(row, s, s.issued) for row, s in enumerate(sequences)]
        for s in sequences:
            s.issued += 1
        return Dispatched(tokens, draws)

    def _decode_args(self, sequences: list[Sequence], rows: int, width: int) -> tuple:
        """(rows, positions, output indices, table, logprobs) padded to `rows` × `width`."""
        slots, positions, index = (
            np.full(rows, self.slots, np.int32),
            np.full(rows, -1, np.int32),
            np.zeros(rows, np.int32),
        )
        table = np.full((rows, width), SCRATCH_PAGE, np.int32)
        for r, s in enumerate(sequences):
            slots[r], positions[r], index[r] = s.slot, s.position, s.issued
            table[r, : len(s.pages)] = s.pages
        return slots, positions, index, table, np.bool_(False)

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
        args = self._prefill_args([rows[c] for c in chunks], count, size, width)
        self.pools, self.slots_state, tokens, prompt = self.prefill_step(*args)
        draws = [(row, c.sequence, c.sequence.issued) for row, c in enumerate(chunks) if c.final]
        scored = [(row, c) for row, c in enumerate(chunks) if c.sequence.scores_prompt and not c.sequence.output]
        for chunk in chunks:
            self.scheduler.advance(chunk)
        return Dispatched(tokens, draws, scored if self.settings.prompt_nll else [], prompt)

    def _prefill_row(self, chunk: Chunk) -> tuple:
        """One chunk's row of a prefill step: (slot, tokens, start, final, output index, the tokens
        following each, pages, sampling settings)."""
        s, request = chunk.sequence, chunk.sequence.generation.request
        sampling = Sampling.one(request.temperature, request.top_k, request.top_p, s.generation.seed, s.choice)
        following = s.target[chunk.start + 1 : chunk.start + chunk.count + 1]
        return s.slot, chunk.tokens, chunk.start, chunk.final, s.issued, following, s.pages, sampling

    def _prefill_args(self, rows: list[tuple], count: int, size: int, width: int) -> tuple:
        """(slots, tokens, starts, lengths, table, final, sampling, output indices, following),
        `rows` padded to `count` rows × `size` tokens × `width` pages."""
        slots, starts, index = (
            np.full(count, self.slots, np.int32),
            np.zeros(count, np.int32),
            np.zeros(count, np.int32),
        )
        tokens, following = np.zeros((count, size), np.int32), np.zeros((count, size), np.int32)
        lengths, final = np.ones(count, np.int32), np.zeros(count, np.bool_)
        table, settings = np.full((count, width), SCRATCH_PAGE, np.int32), [Sampling.one()] * count
        for r, (slot, chunk, start, last, issued, after, pages, sampling) in enumerate(rows):
            slots[r], starts[r], lengths[r], final[r], index[r], settings[r] = (
                slot,
                start,
                len(chunk),
                last,
                issued,
                sampling,
            )
            tokens[r, : len(chunk)], following[r, : len(after)], table[r, : len(pages)] = chunk, after, pages
        sampling = Sampling(*(np.concatenate(field) for field in zip(*settings, strict=True)))
        return slots, tokens, starts, lengths, table, final, sampling, index, following

    def _read(self, step: Dispatched) -> None:
        """Streams what `step` produced; a choice that finishes gives back its pages and slot."""
        tokens = jax.device_get(step.tokens)
        if step.scored:
            self._score_prompts(step.scored, jax.device_get(step.prompt))
        for row, sequence, index in step.draws:
            generation = sequence.generation
            if sequence.state is State.DONE or index != len(sequence.output):
                continue  # it ended after the step was dispatched
            with self._serving(generation):
                if generation._push(sequence.choice, int(tokens.ids[row]), self._logprob(generation, tokens, row)):
                    self.scheduler.finish(sequence)
                    if generation.done:
                        del self._sequences[generation]

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
        """Records the prompt's log-probs and perplexity, and ends the request if the alarm refuses it."""
        s = self.settings
        generation.prompt_logprobs = scored
        generation.perplexity = prompt_perplexity(-generation.prompt_logprobs.logprobs)
        generation.alarm = s.ppl_alarm is not None and max(generation.perplexity) > s.ppl_alarm
        if generation.alarm and s.ppl_reject:
            whole, window = generation.perplexity
            message = (
                f"the prompt's perplexity ({whole:.1f} whole, {window:.1f} in its worst 32-token window) is above "
                f"this server's limit of {s.ppl_alarm:g} (serve.ppl_alarm); send text the model can read"
            )
            self._drop(generation, RequestError(message, "perplexity_alarm", "prompt"))

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
        with jax.set_mesh(self.mesh):
            self._reset()
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

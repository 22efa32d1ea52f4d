"""The serving engine: requests in, tokens and text out, decoded together in a fixed set of slots.

Every device step is compiled when the engine starts (a prefill and an insert per prompt bucket,
one decode step), so no request waits for a compile. `step()` admits waiting requests into free
slots (one prefill per request, inserted into `n` slots for `n` choices), then advances every
busy slot by one token (one decode step computes all slots, busy or not). A choice leaves its
slot as soon as it finishes, and the next request takes it at the next step. `serve_forever()`
steps in a thread of its own while other threads (or an event loop) submit and read.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.errors import JaxllmError
from jaxllm.model.cache import AXES
from jaxllm.model.sampling import Sampling
from jaxllm.parallel.rules import logical_spec
from jaxllm.serve.guards import prompt_perplexity
from jaxllm.serve.steps import (
    TOP_LOGPROBS,
    DecodeState,
    Prefix,
    Tokens,
    bucket_for,
    decode,
    insert,
    prefill,
    prompt_buckets,
)
from jaxllm.serve.stream import MAX_STOPS, TextStream


class RequestError(JaxllmError):
    """A request the engine cannot take; the message names the limit, `code` and `param` (if
    any) say which, as OpenAI's API does."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


class Unavailable(JaxllmError):
    """The engine cannot take a request now: its queue is full, or it has stopped."""


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]  # token ids
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None  # None: a random one
    n: int = 1  # choices, each in its own slot
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report each token's log-prob and this many alternatives (≤ 20)


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's raw model log-probability, and the most likely alternatives (None for a prompt's
    first token, which nothing predicts)."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] | None


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one step added to one choice: its newly final text, its new tokens (with their
    log-probs if asked for), and why it finished, once it has."""

    choice: int
    text: str
    tokens: list[int]
    logprobs: list[Logprob]
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class Choice:
    text: str
    tokens: list[int]
    logprobs: list[Logprob]
    finish_reason: str


class Generation:
    """A submitted request: iterate for its `Delta`s as they come (from any thread, or `async for`
    on the event loop it was submitted with), or wait for `choices()`. If it ended without its
    choices (refused after the prefill, or the engine stopped), `error` says why.

    With `serve.prompt_nll`, `prompt_logprobs` holds each prompt token's log-prob after the first
    (numpy `Tokens`), `perplexity` the prompt's (whole, worst 32-token window), and `alarm` whether
    either passed `serve.ppl_alarm`. `submitted`, `first_token_at` and `finished_at` are
    `time.perf_counter()` readings."""

    def __init__(self, request: Request, tokenizer: Tokenizer, loop: asyncio.AbstractEventLoop | None = None):
        self.request, self.seed = request, secrets.randbits(32) if request.seed is None else request.seed
        self.streams = [
            TextStream(tokenizer, request.max_tokens, request.stop, request.ignore_eos) for _ in range(request.n)
        ]
        self.logprobs: list[list[Logprob]] = [[] for _ in range(request.n)]
        self.prompt_logprobs: Tokens | None = None
        self.perplexity: tuple[float, float] | None = None
        self.alarm = False
        self.error: JaxllmError | None = None
        self.cancelled = False
        self.submitted, self.first_token_at, self.finished_at = time.perf_counter(), None, None
        self._loop = loop
        self._events: queue.SimpleQueue | asyncio.Queue = asyncio.Queue() if loop else queue.SimpleQueue()
        self._unfinished = request.n
        self._done = threading.Event()

    def __iter__(self) -> Iterator[Delta]:
        while (delta := self._events.get()) is not None:
            yield delta

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while (delta := await self._events.get()) is not None:
            yield delta

    def choices(self, timeout: float | None = None) -> list[Choice]:
        if not self._done.wait(timeout):
            raise TimeoutError("the request has not finished")
        if self.error is not None:
            raise self.error
        streams = zip(self.streams, self.logprobs, strict=True)
        return [Choice(s.released, s.tokens, logprobs, s.finish_reason) for s, logprobs in streams]

    def cancel(self) -> None:
        """Frees the request's slots at the engine's next step (a client that went away)."""
        self.cancelled = True

    def _emit(self, event: Delta | None) -> None:
        if self._loop is None:
            self._events.put(event)
        elif not self._loop.is_closed():  # closed: the server has shut down, and no one reads
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def _push(self, choice: int, token: int, logprob: Logprob | None) -> bool:
        """Feeds a choice its next token; True once it has finished."""
        stream = self.streams[choice]
        text = stream.push(token)
        self.first_token_at = self.first_token_at or time.perf_counter()
        if logprob is not None:
            self.logprobs[choice].append(logprob)
        self._emit(Delta(choice, text, [token], [logprob] if logprob else [], stream.finish_reason))
        if stream.finish_reason is not None:
            self._unfinished -= 1
            if not self._unfinished:
                self._end()
        return stream.finish_reason is not None

    def _end(self, error: JaxllmError | None = None) -> None:
        if not self._done.is_set():
            self.error, self.finished_at = error, time.perf_counter()
            self._done.set()
            self._emit(None)


class Engine:
    """Serves `params` (in `mesh`'s shardings) of the model in `cfg` (see `serve.settings.serving_config`)."""

    def __init__(self, params: dict, cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, mesh: Mesh):
        self.params, self.cfg, self.tokenizer, self.mesh = params, cfg, tokenizer, mesh
        s, model = cfg.serve, cfg.model
        self.slots, self.max_len = s.slots, s.max_len
        self.buckets = prompt_buckets(s.max_prompt_tokens, s.max_len)
        self.max_prompt = min(s.max_prompt_tokens, s.max_len - 1)  # a prompt leaves room for one token
        self.vocab_size = min(tokenizer.vocab_size, model.vocab_size)  # ids past the tokenizer's are never drawn
        self._waiting: collections.deque[Generation] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set by submit, for serve_forever
        self._free = list(range(s.slots))[::-1]
        self._active: dict[int, tuple[Generation, int]] = {}  # slot → (request, choice)
        self.failure: BaseException | None = None  # why serve_forever stopped, if a step failed
        with jax.set_mesh(mesh):
            cache = NamedSharding(mesh, logical_spec(AXES))  # an int8 cache's scales too (their head_dim is 1)
            replicated = NamedSharding(mesh, P())
            state = DecodeState.empty(model, s.slots, s.max_len, s.kv_dtype)
            shardings = DecodeState(
                jax.tree.map(lambda _: cache, state.cache), *(jax.tree.map(lambda _: replicated, state[1:]))
            )
            self.state = jax.device_put(state, shardings)
            self._compile(model, shardings)

    def _compile(self, model: ml_collections.ConfigDict, shardings: DecodeState) -> None:
        """Every step the engine will run, compiled now: a prefill and an insert per prompt bucket,
        and the decode step, each with its outputs' shardings fixed and the decode state donated."""
        cache, replicated = shardings.cache, shardings.tokens
        one, self._prefill, self._insert = Sampling.one(), {}, {}
        prefix_shardings = Prefix(cache, replicated, replicated, replicated)
        for bucket in self.buckets:
            tokens, length = jnp.zeros(bucket, jnp.int32), jnp.int32(1)
            prefill_step = partial(prefill, model=model, vocab_size=self.vocab_size, logprobs=self.cfg.serve.prompt_nll,
                                   kv_dtype=self.cfg.serve.kv_dtype)  # fmt: skip
            prefill_step = jax.jit(prefill_step, out_shardings=prefix_shardings)
            self._prefill[bucket] = prefill_step.lower(self.params, tokens, length).compile()
            prefix = jax.eval_shape(prefill_step, self.params, tokens, length)
            insert_step = jax.jit(
                partial(insert, vocab_size=self.vocab_size), out_shardings=(shardings, None), donate_argnums=1
            )
            self._insert[bucket] = insert_step.lower(prefix, self.state, jnp.int32(0), one).compile()
        step = partial(decode, model=model, vocab_size=self.vocab_size)
        step = jax.jit(step, out_shardings=(shardings, None), donate_argnums=1)
        self.decode_step = step.lower(self.params, self.state, jnp.bool_(True)).compile()

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> Generation:
        """Queues a request (from any thread; with `loop`, read it with `async for` there). Raises
        `RequestError` if it cannot be served, `Unavailable` if the queue is full or the engine
        has stopped."""
        self.check(request)
        generation = Generation(request, self.tokenizer, loop)
        with self._lock:
            if self.failure is not None:
                raise Unavailable(f"the engine has stopped: {self.failure!r}")
            if len(self._waiting) >= self.cfg.serve.max_queue + len(self._free):  # the free slots take some now
                raise Unavailable(f"all {self.cfg.serve.max_queue} queue places are taken (serve.max_queue)")
            self._waiting.append(generation)
        self._wake.set()
        return generation

    def generate(self, requests: list[Request]) -> list[Generation]:
        """Submits `requests` and steps until all have finished."""
        generations = [self.submit(r) for r in requests]
        while self.busy():
            self.step()
        return generations

    def busy(self) -> bool:
        return bool(self._active or self._waiting)

    def queued(self) -> int:
        return len(self._waiting)

    def active_slots(self) -> int:
        return len(self._active)

    def cache_usage(self) -> float:
        """The fraction of the KV cache the active slots fill."""
        held = sum(len(g.request.prompt) + len(g.streams[c].tokens) for g, c in list(self._active.values()))
        return held / (self.slots * self.max_len)

    def serve_forever(self, stop: threading.Event, on_step: Callable[[int], None] = lambda slots: None) -> None:
        """Steps whenever there is work until `stop` is set, calling `on_step` with each decode
        step's busy slots. If a step fails, every request ends with the error, new ones are
        refused (`Unavailable`), and the error is raised."""
        try:
            while not stop.is_set():
                if not self.busy():
                    self._wake.wait(0.1)
                    self._wake.clear()
                elif slots := self.step():
                    on_step(slots)
        except BaseException as failure:
            with self._lock:
                self.failure, waiting = failure, list(self._waiting)
                self._waiting.clear()
            stopped = Unavailable(f"the engine has stopped: {failure!r}")
            for generation in waiting + [g for g, _ in self._active.values()]:
                generation._end(stopped)
            self._active.clear()
            raise

    def step(self) -> int:
        """Admits what fits, then one decode step for all slots; returns how many were busy."""
        self._admit()
        for slot, (generation, _) in list(self._active.items()):
            if generation.cancelled:
                self._release(slot)
                generation._end()
        if not self._active:
            return 0
        busy = len(self._active)
        logprobs = any(g.request.logprobs is not None for g, _ in self._active.values())
        self.state, tokens = self.decode_step(self.params, self.state, np.bool_(logprobs))
        tokens = jax.device_get(tokens)
        for slot, (generation, choice) in list(self._active.items()):
            if generation._push(choice, int(tokens.ids[slot]), self._logprob(generation, tokens, slot)):
                self._release(slot)
        return busy

    def _admit(self) -> None:
        """First come, first served: a request waits until its `n` slots are free; one whose
        client went away leaves the queue."""
        while True:
            with self._lock:
                self._waiting = collections.deque(g for g in self._waiting if not g.cancelled)
                if not self._waiting or len(self._free) < self._waiting[0].request.n:
                    return
                generation = self._waiting.popleft()
            self._start(generation)

    def _start(self, generation: Generation) -> None:
        r = generation.request
        bucket = bucket_for(len(r.prompt), self.buckets)
        tokens = np.zeros(bucket, np.int32)
        tokens[: len(r.prompt)] = r.prompt
        prefix: Prefix = self._prefill[bucket](self.params, tokens, np.int32(len(r.prompt)))
        if self.cfg.serve.prompt_nll and not self._judge(generation, prefix):
            return
        for choice in range(r.n):
            slot = self._free.pop()
            sampling = Sampling.one(r.temperature, r.top_k, r.top_p, generation.seed, choice)
            self.state, first = self._insert[bucket](prefix, self.state, np.int32(slot), sampling)
            first = jax.device_get(first)
            self._active[slot] = (generation, choice)
            if generation._push(choice, int(first.ids[0]), self._logprob(generation, first, 0)):
                self._release(slot)

    def _judge(self, generation: Generation, prefix: Prefix) -> bool:
        """Records the prompt's log-probs and perplexity; False if the alarm refuses it."""
        s, prompt = self.cfg.serve, jax.device_get(prefix.prompt)
        generation.prompt_logprobs = Tokens(*(a[: len(generation.request.prompt) - 1] for a in prompt))
        generation.perplexity = prompt_perplexity(-generation.prompt_logprobs.logprobs)
        generation.alarm = s.ppl_alarm is not None and max(generation.perplexity) > s.ppl_alarm
        if generation.alarm and s.ppl_reject:
            whole, window = generation.perplexity
            message = (
                f"the prompt's perplexity ({whole:.1f} whole, {window:.1f} in its worst 32-token window) is above "
                f"this server's limit of {s.ppl_alarm:g} (serve.ppl_alarm); send text the model can read"
            )
            generation._end(RequestError(message, "perplexity_alarm", "prompt"))
        return generation.error is None

    def _release(self, slot: int) -> None:
        del self._active[slot]
        self._free.append(slot)

    @staticmethod
    def _logprob(generation: Generation, tokens, row: int) -> Logprob | None:
        top = generation.request.logprobs
        if top is None:
            return None
        alternatives = zip(tokens.top_ids[row, :top].tolist(), tokens.top_logprobs[row, :top].tolist(), strict=True)
        return Logprob(int(tokens.ids[row]), float(tokens.logprobs[row]), list(alternatives))

    def check(self, r: Request) -> None:
        """Raises `RequestError`, naming the limit, if `r` cannot be served."""

        def require(ok: bool, message: str, code: str | None = None, param: str | None = None) -> None:
            if not ok:
                raise RequestError(message, code, param)

        require(len(r.prompt) >= 1, "the prompt is empty; give at least one token")
        too_long = len(r.prompt) > self.max_prompt
        require(
            not too_long and len(r.prompt) + r.max_tokens <= self.max_len,
            f"the prompt has {len(r.prompt)} tokens and max_tokens is {r.max_tokens}; this server takes prompts of "
            f"at most {self.max_prompt} tokens (serve.max_prompt_tokens, and serve.max_len less one) and at most "
            f"{self.max_len} tokens of prompt and output together (serve.max_len); shorten the prompt or lower "
            "max_tokens",
            code="context_length_exceeded",
            param="prompt" if too_long else "max_tokens",
        )
        require(r.max_tokens >= 1, f"max_tokens={r.max_tokens} must be at least 1", param="max_tokens")
        require(
            all(0 <= t < self.vocab_size for t in r.prompt),
            f"prompt token ids must be in [0, {self.vocab_size})",
            param="prompt",
        )
        require(
            1 <= r.n <= self.slots, f"n={r.n} must be between 1 and the {self.slots} slots (serve.slots)", param="n"
        )
        require(
            r.temperature >= 0, f"temperature={r.temperature} must be at least 0 (0 is greedy)", param="temperature"
        )
        require(r.top_k >= 0, f"top_k={r.top_k} must be at least 0 (0: no limit)", param="top_k")
        require(0 < r.top_p <= 1, f"top_p={r.top_p} must be in (0, 1]", param="top_p")
        require(r.seed is None or 0 <= r.seed < 2**32, f"seed={r.seed} must be in [0, 2**32)", param="seed")
        require(
            len(r.stop) <= MAX_STOPS, f"{len(r.stop)} stop strings given; at most {MAX_STOPS} are allowed", param="stop"
        )
        require(
            r.logprobs is None or 0 <= r.logprobs <= TOP_LOGPROBS,
            f"logprobs={r.logprobs} must be between 0 and {TOP_LOGPROBS}",
            param="logprobs",
        )

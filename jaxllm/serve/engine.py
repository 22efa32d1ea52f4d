"""The serving engine: requests in, tokens and text out, decoded together in a fixed set of slots.

Every device step is compiled when the engine starts (a prefill and an insert per prompt bucket,
one decode step), so no request waits for a compile. `step()` admits waiting requests into free
slots (one prefill per request, inserted into `n` slots for `n` choices), then advances every
busy slot by one token (one decode step computes all slots, busy or not). A choice leaves its
slot as soon as it finishes, and the next request takes it at the next step. `serve_forever()`
steps in a thread of its own while other threads (or an event loop) submit and read.

A request can fail only itself: whatever serving one request raises (its admission, prefill,
sampling settings, stop strings or text) ends that request alone, and a request past its
deadline (`serve.request_timeout_s`) ends with an error and frees its slots. Only a failed
decode step, which every busy slot shares, ends the busy requests: the engine then rebuilds its
decode state and serves on, up to `serve.max_engine_restarts` failed steps in a row.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.model.cache import AXES
from jaxllm.model.decoder import Model
from jaxllm.model.sampling import Sampling
from jaxllm.parallel.rules import logical_spec
from jaxllm.serve.generation import (
    Generation,
    Limits,
    Logprob,
    Request,
    RequestError,
    RequestFailed,
    Unavailable,
)
from jaxllm.serve.guards import prompt_perplexity
from jaxllm.serve.settings import Serving
from jaxllm.serve.steps import DecodeState, Prefix, Tokens, bucket_for, decode, insert, prefill, prompt_buckets

log = logging.getLogger("jaxllm.serve")


class Engine:
    """Serves `params` (in `mesh`'s shardings) of `serving.model` as `serving.settings` say (see
    `serve.settings.serving_config`)."""

    def __init__(self, params: dict, serving: Serving, tokenizer: Tokenizer, mesh: Mesh):
        self.params, self.tokenizer, self.mesh = params, tokenizer, mesh
        self.settings = s = serving.settings
        self.model = Model(serving.model)  # built once: every step below binds its graph to the params
        self.limits = Limits.of(serving, tokenizer)
        self.slots, self.max_len, self.vocab_size = s.slots, s.max_len, self.limits.vocab_size
        self.buckets = prompt_buckets(s.max_prompt_tokens, s.max_len)
        self._waiting: collections.deque[Generation] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set by submit, for serve_forever
        self._free = list(range(s.slots))[::-1]
        self._active: dict[int, tuple[Generation, int]] = {}  # slot → (request, choice)
        self.failure: BaseException | None = None  # why the engine stopped, if it did
        self.restarts = 0  # decode states rebuilt after a failed step
        self._failed_in_a_row = 0
        with jax.set_mesh(mesh):
            cache = NamedSharding(mesh, logical_spec(AXES))  # an int8 cache's scales too (their head_dim is 1)
            replicated = NamedSharding(mesh, P())
            state = DecodeState.empty(serving.model, s.slots, s.max_len, s.kv_dtype)
            self._shardings = DecodeState(
                jax.tree.map(lambda _: cache, state.cache), *(jax.tree.map(lambda _: replicated, state[1:]))
            )
            self.state = jax.device_put(state, self._shardings)
            self._compile(self.model, self._shardings)

    def _compile(self, model: Model, shardings: DecodeState) -> None:
        """Every step the engine will run, compiled now: a prefill and an insert per prompt bucket,
        and the decode step, each with its outputs' shardings fixed and the decode state donated."""
        cache, replicated = shardings.cache, shardings.tokens
        one, self._prefill, self._insert = Sampling.one(), {}, {}
        prefix_shardings = Prefix(cache, replicated, replicated, replicated)
        for bucket in self.buckets:
            tokens, length = jnp.zeros(bucket, jnp.int32), jnp.int32(1)
            prefill_step = partial(prefill, model=model, vocab_size=self.vocab_size, logprobs=self.settings.prompt_nll,
                                   kv_dtype=self.settings.kv_dtype)  # fmt: skip
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
            if len(self._waiting) >= s.max_queue + len(self._free):  # the free slots take some now
                raise Unavailable(f"all {s.max_queue} queue places are taken (serve.max_queue)")
            self._waiting.append(generation)
        self._wake.set()
        return generation

    def generate(self, requests: list[Request]) -> list[Generation]:
        """Submits `requests` and steps until all have ended (each has a deadline)."""
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
        step's busy slots. If the engine stops (more failed steps in a row than
        `serve.max_engine_restarts`), every request ends with the error, new ones are refused
        (`Unavailable`), and the error is raised."""
        try:
            while not stop.is_set():
                if not self.busy():
                    self._wake.wait(0.1)
                    self._wake.clear()
                elif slots := self.step():
                    on_step(slots)
        except BaseException as failure:
            self._stop(failure)
            raise

    def step(self) -> int:
        """Admits what fits, then one decode step for all slots; returns how many were busy."""
        self._admit()
        now = time.monotonic()
        for slot, (generation, _) in list(self._active.items()):
            if slot in self._active and (generation.cancelled or now >= generation.deadline):
                self._drop(generation, None if generation.cancelled else self._late(generation))
        if not self._active:
            return 0
        busy = len(self._active)
        logprobs = any(g.request.logprobs is not None for g, _ in self._active.values())
        try:
            self.state, tokens = self.decode_step(self.params, self.state, np.bool_(logprobs))
            tokens = jax.device_get(tokens)
        except Exception as failure:
            self._restart(failure)
            return 0
        self._failed_in_a_row = 0
        for slot, (generation, choice) in list(self._active.items()):
            if slot in self._active:  # not left with a failed choice of the same request
                with self._serving(generation):
                    if generation._push(choice, int(tokens.ids[slot]), self._logprob(generation, tokens, slot)):
                        self._release(slot)
        return busy

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
        """Ends `generation` (with `error`, if any) and frees its slots."""
        for slot, (g, _) in list(self._active.items()):
            if g is generation:
                self._release(slot)
        generation._end(error)

    def _late(self, generation: Generation) -> RequestFailed:
        timeout = self.settings.request_timeout_s
        message = (f"request {generation.id} ran past its deadline of {timeout:g} s (serve.request_timeout_s) and was "
                   "stopped; ask for fewer tokens, or retry when the server is less busy")  # fmt: skip
        return RequestFailed(message, "timeout")

    def _restart(self, failure: Exception) -> None:
        """A failed decode step: the busy requests end with the error and the decode state is
        rebuilt; past `serve.max_engine_restarts` failures in a row, the engine stops."""
        self._failed_in_a_row += 1
        if self._failed_in_a_row > self.settings.max_engine_restarts:
            self._stop(failure)
            raise failure
        log.exception("a decode step failed; rebuilding the decode state (restart %d)", self.restarts + 1)
        for generation in {g for g, _ in self._active.values()}:
            message = (f"request {generation.id} was lost when a decode step failed ({type(failure).__name__}) "
                       "and the engine restarted; retry it")  # fmt: skip
            self._drop(generation, RequestFailed(message, "internal_error"))
        empty = DecodeState.empty(self.model.config, self.slots, self.max_len, self.settings.kv_dtype)
        self.state = jax.device_put(empty, self._shardings)
        self.restarts += 1

    def _stop(self, failure: BaseException) -> None:
        """Stops for good: every request ends with `Unavailable`, and new ones are refused."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure, waiting = failure, list(self._waiting)
            self._waiting.clear()
        stopped = Unavailable(f"the engine has stopped: {failure!r}")
        for generation in waiting + [g for g, _ in self._active.values()]:
            generation._end(stopped)
        self._active.clear()
        self._free = list(range(self.slots))[::-1]

    def _admit(self) -> None:
        """First come, first served: a request waits until its `n` slots are free; one whose
        client went away leaves the queue, and one past its deadline ends with an error."""
        now = time.monotonic()
        while True:
            with self._lock:
                gone = {g for g in self._waiting if g.cancelled or now >= g.deadline}
                self._waiting = collections.deque(g for g in self._waiting if g not in gone)
                ready = self._waiting and len(self._free) >= self._waiting[0].request.n
                generation = self._waiting.popleft() if ready else None
            for g in gone:
                g._end(None if g.cancelled else self._late(g))
            if generation is None:
                return
            with self._serving(generation):
                self._start(generation)

    def _start(self, generation: Generation) -> None:
        r = generation.request
        bucket = bucket_for(len(r.prompt), self.buckets)
        tokens = np.zeros(bucket, np.int32)
        tokens[: len(r.prompt)] = r.prompt
        prefix: Prefix = self._prefill[bucket](self.params, tokens, np.int32(len(r.prompt)))
        if self.settings.prompt_nll and not self._judge(generation, prefix):
            return
        for choice in range(r.n):
            sampling = Sampling.one(r.temperature, r.top_k, r.top_p, generation.seed, choice)
            slot = self._free.pop()
            self._active[slot] = (generation, choice)
            self.state, first = self._insert[bucket](prefix, self.state, np.int32(slot), sampling)
            first = jax.device_get(first)
            if generation._push(choice, int(first.ids[0]), self._logprob(generation, first, 0)):
                self._release(slot)

    def _judge(self, generation: Generation, prefix: Prefix) -> bool:
        """Records the prompt's log-probs and perplexity; False if the alarm refuses it."""
        s, prompt = self.settings, jax.device_get(prefix.prompt)
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

"""The serving engine: requests in, tokens and text out, decoded together in a fixed set of slots.

Every device step is compiled when the engine starts (a prefill and an insert per prompt bucket,
one decode step), so no request waits for a compile. `step()` admits waiting requests into free
slots (one prefill per request, inserted into `n` slots for `n` choices), then advances every
busy slot by one token (one decode step computes all slots, busy or not). A choice leaves its
slot as soon as it finishes, and the next request takes it at the next step.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import secrets
import threading
from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.errors import JaxllmError
from jaxllm.model.cache import AXES, KVCache
from jaxllm.model.sampling import Sampling
from jaxllm.parallel.rules import logical_spec
from jaxllm.serve.steps import TOP_LOGPROBS, DecodeState, Prefix, bucket_for, decode, insert, prefill, prompt_buckets
from jaxllm.serve.stream import MAX_STOPS, TextStream


class RequestError(JaxllmError):
    """A request the engine cannot take; the message names the limit."""


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
    """A generated token's raw model log-probability, and the most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


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
    """A submitted request: iterate for its `Delta`s as they come (from any thread), or wait for
    `choices()`. `prompt_nll` is each prompt token's negative log-likelihood (the first's is 0),
    if the server computes them (`serve.prompt_nll`)."""

    def __init__(self, request: Request, tokenizer: Tokenizer):
        self.request, self.seed = request, secrets.randbits(32) if request.seed is None else request.seed
        self.streams = [
            TextStream(tokenizer, request.max_tokens, request.stop, request.ignore_eos) for _ in range(request.n)
        ]
        self.logprobs: list[list[Logprob]] = [[] for _ in range(request.n)]
        self.prompt_nll: list[float] | None = None
        self.cancelled = False
        self._events: queue.SimpleQueue[Delta | None] = queue.SimpleQueue()
        self._unfinished = request.n
        self._done = threading.Event()

    def __iter__(self) -> Iterator[Delta]:
        while (delta := self._events.get()) is not None:
            yield delta

    def choices(self, timeout: float | None = None) -> list[Choice]:
        if not self._done.wait(timeout):
            raise TimeoutError("the request has not finished")
        streams = zip(self.streams, self.logprobs, strict=True)
        return [Choice(s.released, s.tokens, logprobs, s.finish_reason) for s, logprobs in streams]

    def cancel(self) -> None:
        """Frees the request's slots at the engine's next step (a client that went away)."""
        self.cancelled = True

    def _push(self, choice: int, token: int, logprob: Logprob | None) -> bool:
        """Feeds a choice its next token; True once it has finished."""
        stream = self.streams[choice]
        text = stream.push(token)
        if logprob is not None:
            self.logprobs[choice].append(logprob)
        self._events.put(Delta(choice, text, [token], [logprob] if logprob else [], stream.finish_reason))
        if stream.finish_reason is not None:
            self._unfinished -= 1
            if not self._unfinished:
                self._done.set()
                self._events.put(None)
        return stream.finish_reason is not None


class Engine:
    """Serves `params` (in `mesh`'s shardings) of the model in `cfg` (see `config.serving_config`)."""

    def __init__(self, params: dict, cfg: ml_collections.ConfigDict, tokenizer: Tokenizer, mesh: Mesh):
        self.params, self.cfg, self.tokenizer, self.mesh = params, cfg, tokenizer, mesh
        s, model = cfg.serve, cfg.model
        self.slots, self.max_len = s.slots, s.max_len
        self.buckets = prompt_buckets(s.max_prompt_tokens, s.max_len)
        self.max_prompt = min(s.max_prompt_tokens, s.max_len - 1)  # a prompt leaves room for one token
        self.vocab_size = min(tokenizer.vocab_size, model.vocab_size)  # ids past the tokenizer's are never drawn
        self._waiting: collections.deque[Generation] = collections.deque()
        self._lock = threading.Lock()
        self._free = list(range(s.slots))[::-1]
        self._active: dict[int, tuple[Generation, int]] = {}  # slot → (request, choice)
        with jax.set_mesh(mesh):
            cache = NamedSharding(mesh, logical_spec(AXES))
            replicated = NamedSharding(mesh, P())
            state = DecodeState.empty(model, s.slots, s.max_len)
            shardings = DecodeState(KVCache(cache, cache), *(jax.tree.map(lambda _: replicated, state[1:])))
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
            prefill_step = partial(prefill, model=model, nll=self.cfg.serve.prompt_nll)
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

    def submit(self, request: Request) -> Generation:
        """Queues a request (from any thread); raises `RequestError` if it cannot be served."""
        self._check(request)
        generation = Generation(request, self.tokenizer)
        with self._lock:
            self._waiting.append(generation)
        return generation

    def generate(self, requests: list[Request]) -> list[Generation]:
        """Submits `requests` and steps until all have finished."""
        generations = [self.submit(r) for r in requests]
        while self.step():
            pass
        return generations

    def busy(self) -> bool:
        return bool(self._active or self._waiting)

    def step(self) -> bool:
        """Admits what fits, then one decode step for all slots; True while work remains."""
        self._admit()
        for slot, (generation, _) in list(self._active.items()):
            if generation.cancelled:
                self._release(slot)
        if self._active:
            logprobs = any(g.request.logprobs is not None for g, _ in self._active.values())
            self.state, tokens = self.decode_step(self.params, self.state, np.bool_(logprobs))
            tokens = jax.device_get(tokens)
            for slot, (generation, choice) in list(self._active.items()):
                if generation._push(choice, int(tokens.ids[slot]), self._logprob(generation, tokens, slot)):
                    self._release(slot)
        return self.busy()

    def _admit(self) -> None:
        """First come, first served: a request waits until its `n` slots are free."""
        while True:
            with self._lock:
                if not self._waiting or len(self._free) < self._waiting[0].request.n:
                    return
                generation = self._waiting.popleft()
            if not generation.cancelled:
                self._start(generation)

    def _start(self, generation: Generation) -> None:
        r = generation.request
        bucket = bucket_for(len(r.prompt), self.buckets)
        tokens = np.zeros(bucket, np.int32)
        tokens[: len(r.prompt)] = r.prompt
        prefix: Prefix = self._prefill[bucket](self.params, tokens, np.int32(len(r.prompt)))
        if self.cfg.serve.prompt_nll:
            generation.prompt_nll = jax.device_get(prefix.nll)[: len(r.prompt)].tolist()
        for choice in range(r.n):
            slot = self._free.pop()
            sampling = Sampling.one(r.temperature, r.top_k, r.top_p, generation.seed, choice)
            self.state, first = self._insert[bucket](prefix, self.state, np.int32(slot), sampling)
            first = jax.device_get(first)
            self._active[slot] = (generation, choice)
            if generation._push(choice, int(first.ids[0]), self._logprob(generation, first, 0)):
                self._release(slot)

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

    def _check(self, r: Request) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise RequestError(message)

        require(len(r.prompt) >= 1, "the prompt is empty; give at least one token")
        require(
            len(r.prompt) <= self.max_prompt,
            f"the prompt has {len(r.prompt)} tokens; this server takes at most {self.max_prompt} "
            "(serve.max_prompt_tokens, and serve.max_len less one); shorten it",
        )
        require(r.max_tokens >= 1, f"max_tokens={r.max_tokens} must be at least 1")
        require(
            len(r.prompt) + r.max_tokens <= self.max_len,
            f"the prompt's {len(r.prompt)} tokens and max_tokens={r.max_tokens} exceed the {self.max_len} tokens "
            f"a slot holds (serve.max_len); ask for at most {self.max_len - len(r.prompt)} tokens",
        )
        require(all(0 <= t < self.vocab_size for t in r.prompt), f"prompt token ids must be in [0, {self.vocab_size})")
        require(1 <= r.n <= self.slots, f"n={r.n} must be between 1 and the {self.slots} slots (serve.slots)")
        require(r.temperature >= 0, f"temperature={r.temperature} must be at least 0 (0 is greedy)")
        require(r.top_k >= 0, f"top_k={r.top_k} must be at least 0 (0: no limit)")
        require(0 < r.top_p <= 1, f"top_p={r.top_p} must be in (0, 1]")
        require(r.seed is None or 0 <= r.seed < 2**32, f"seed={r.seed} must be in [0, 2**32)")
        require(len(r.stop) <= MAX_STOPS, f"{len(r.stop)} stop strings given; at most {MAX_STOPS} are allowed")
        require(
            r.logprobs is None or 0 <= r.logprobs <= TOP_LOGPROBS,
            f"logprobs={r.logprobs} must be between 0 and {TOP_LOGPROBS}",
        )

"""A request to the serving engine and what becomes of it: its settings and every bound on them,
its deltas as they are decoded, its choices once it ends, and how it ended (finished, refused,
failed or past its deadline). The engine thread writes a `Generation`, any other thread or an
event loop reads it, and every read has an end. Nothing here needs JAX: the HTTP layer and the
engine's host side share these types with the device side."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import queue
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.errors import JaxllmError
from jaxllm.serve.settings import Serving
from jaxllm.serve.stream import EMPTY_STOP, MAX_STOPS, TextStream

if TYPE_CHECKING:
    from jaxllm.serve.constraints import Constraint

TOP_LOGPROBS = 20
SEEDS = 2**32  # a seed is a uint32 on the device
# A reader waits this long past a request's deadline before it gives up on the engine thread
# itself (stuck in a device call, say); a live engine ends the request at its deadline.
READ_GRACE_S = 10.0


class Tokens(NamedTuple):
    """What a step produced, per row, with the model's raw log-probabilities (before
    temperature, top-k, top-p and any constraint) when asked for (zeros otherwise): device arrays
    from a step, numpy ones once read back."""

    ids: Any
    logprobs: Any  # of each chosen token
    top_ids: Any  # [.., TOP_LOGPROBS] the most likely tokens, most likely first
    top_logprobs: Any

    @classmethod
    def without_logprobs(cls, ids: Any, xp: Any = np) -> Tokens:
        """`ids` with zeros for their log-probs, as arrays of `xp` (numpy, or jax.numpy on a device)."""
        zeros = xp.zeros(ids.shape, xp.float32)
        top = xp.zeros((*ids.shape, TOP_LOGPROBS), xp.int32)
        return cls(ids, zeros, top, top.astype(xp.float32))


class RequestError(JaxllmError):
    """A request the engine cannot take; the message names the limit, `code` and `param` (if
    any) say which, as OpenAI's API does."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


class Unavailable(JaxllmError):
    """The engine cannot take a request now: its queue is full, or it has stopped."""


class RequestFailed(Exception):
    """A request the engine took but could not finish: serving it raised (`code` 'internal_error',
    logged with its traceback; the engine serves the others on), or it ran past its deadline
    (`code` 'timeout')."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


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
    constraint: Constraint | None = None  # the output must match this grammar (see `constraints`)
    min_p: float = 0.0  # 0: no limit; else only tokens at least min_p times as likely as the likeliest


@dataclasses.dataclass(frozen=True)
class Limits:
    """Every bound on one request to an engine: what `check` enforces and what the HTTP schema
    declares, so the two cannot disagree."""

    slots: int
    max_len: int  # prompt and output tokens together
    max_prompt: int  # prompt tokens: serve.max_prompt_tokens, and room for one output token
    vocab_size: int  # token ids below this (the tokenizer's and the model's, whichever is fewer)
    stops: int = MAX_STOPS
    top_logprobs: int = TOP_LOGPROBS

    @classmethod
    def of(cls, serving: Serving, tokenizer: Tokenizer) -> Limits:
        """The limits of `serving` (see `serve.settings.serving_config`) with `tokenizer`."""
        s = serving.settings
        vocab = min(tokenizer.vocab_size, serving.model.vocab_size)
        return cls(s.slots, s.max_len, min(s.max_prompt_tokens, s.max_len - 1), vocab)

    def check(self, r: Request) -> None:
        """Raises `RequestError`, naming the limit, if `r` cannot be served."""

        def require(ok: bool, message: str, code: str | None = None, param: str | None = None) -> None:
            if not ok:
                raise RequestError(message, code, param)

        require(len(r.prompt) >= 1, "the prompt is empty; give at least one token", param="prompt")
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
            math.isfinite(r.temperature) and r.temperature >= 0,
            f"temperature={r.temperature} must be a number of at least 0 (0 is greedy)",
            param="temperature",
        )
        require(
            0 <= r.top_k <= self.vocab_size,
            f"top_k={r.top_k} must be between 0 (no limit) and the vocabulary's {self.vocab_size}",
            param="top_k",
        )
        require(0 < r.top_p <= 1, f"top_p={r.top_p} must be in (0, 1]", param="top_p")
        require(0 <= r.min_p <= 1, f"min_p={r.min_p} must be in [0, 1]", param="min_p")
        require(r.seed is None or 0 <= r.seed < SEEDS, f"seed={r.seed} must be in [0, 2**32)", param="seed")
        require(
            len(r.stop) <= self.stops,
            f"{len(r.stop)} stop strings given; at most {self.stops} are allowed",
            param="stop",
        )
        require(all(r.stop), EMPTY_STOP, param="stop")
        require(
            r.constraint is None or not r.ignore_eos,
            "ignore_eos cannot be set with a structured output: its end is where the grammar's output ends",
            param="ignore_eos",
        )
        require(
            r.logprobs is None or 0 <= r.logprobs <= self.top_logprobs,
            f"logprobs={r.logprobs} must be between 0 and {self.top_logprobs}",
            param="logprobs",
        )


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
    choices (refused after the prefill, failed, past its deadline, or the engine stopped), `error`
    says why, and reading raises it. No read waits past `deadline` (a `time.monotonic()` reading)
    by more than `READ_GRACE_S`.

    With `serve.prompt_nll`, `prompt_logprobs` holds each prompt token's log-prob after the first
    (numpy `Tokens`), `perplexity` the prompt's (whole, worst 32-token window), and `alarm` whether
    either passed `serve.ppl_alarm`. `submitted`, `scheduled_at` (its first choice's first
    admission), `first_token_at` and `finished_at` are `time.perf_counter()` readings."""

    def __init__(
        self,
        request: Request,
        tokenizer: Tokenizer,
        deadline: float,
        loop: asyncio.AbstractEventLoop | None = None,
        request_id: str | None = None,
    ):
        self.request, self.seed = request, secrets.randbits(32) if request.seed is None else request.seed
        self.id, self.deadline = request_id or uuid.uuid4().hex, deadline
        self.streams = [
            TextStream(tokenizer, request.max_tokens, request.stop, request.ignore_eos) for _ in range(request.n)
        ]
        self.logprobs: list[list[Logprob]] = [[] for _ in range(request.n)]
        self.matchers = [request.constraint.matcher() for _ in range(request.n)] if request.constraint else None
        self.prompt_logprobs: Tokens | None = None
        self.perplexity: tuple[float, float] | None = None
        self.alarm = False
        self.error: Exception | None = None
        self.cancelled = False
        self.submitted, self.scheduled_at, self.first_token_at, self.finished_at = time.perf_counter(), None, None, None
        self._loop = loop
        self._events: queue.SimpleQueue | asyncio.Queue = asyncio.Queue() if loop else queue.SimpleQueue()
        self._unfinished = request.n
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _patience(self) -> float:
        """Seconds a reader still waits for the engine."""
        return max(0.0, self.deadline + READ_GRACE_S - time.monotonic())

    def __iter__(self) -> Iterator[Delta]:
        try:
            while (delta := self._events.get(timeout=self._patience())) is not None:
                yield delta
        except queue.Empty:
            raise TimeoutError(f"request {self.id} got no answer from the engine by its deadline") from None

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            while (delta := await asyncio.wait_for(self._events.get(), self._patience())) is not None:
                yield delta
        except TimeoutError:
            raise TimeoutError(f"request {self.id} got no answer from the engine by its deadline") from None

    def choices(self, timeout: float | None = None) -> list[Choice]:
        """Waits for the end (at most `timeout` seconds, by default until past the deadline)."""
        if not self._done.wait(self._patience() if timeout is None else timeout):
            raise TimeoutError(f"request {self.id} has not finished")
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
            return
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop has closed: the server has shut down, and no one reads
            pass

    def allowed(self, choice: int, row: np.ndarray) -> None:
        """Writes the tokens a constrained choice may draw next into `row`, a bitmask (a bit per
        token id, 32 to an int32)."""
        self.matchers[choice].fill(row)

    def _push(self, choice: int, token: int, logprob: Logprob | None) -> bool:
        """Feeds a choice its next token; True once it has finished (a constrained one also when
        its grammar's output is complete)."""
        stream = self.streams[choice]
        text = stream.push(token)
        if self.matchers and stream.finish_reason is None and self.matchers[choice].take(token):
            text += stream.end()
        self.first_token_at = self.first_token_at or time.perf_counter()
        if logprob is not None:
            self.logprobs[choice].append(logprob)
        self._emit(Delta(choice, text, [token], [logprob] if logprob else [], stream.finish_reason))
        if stream.finish_reason is not None:
            self._unfinished -= 1
            if not self._unfinished:
                self._end()
        return stream.finish_reason is not None

    def _end(self, error: Exception | None = None) -> None:
        if not self._done.is_set():
            self.error, self.finished_at = error, time.perf_counter()
            self._done.set()
            self._emit(None)

"""What the HTTP routes share: the engine (once compiled), the tokenizer and chat template, the
request schemas bounded by the engine's limits, and the guards each request passes, in order."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request as HttpRequest
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from jaxllm.data.chat import ChatTemplate, ChatTemplateError
from jaxllm.data.tokenizer import Tokenizer
from jaxllm.serve import protocol, structured
from jaxllm.serve.aio import chain
from jaxllm.serve.api_error import FAILURES, ApiError
from jaxllm.serve.constraints import Constraint, Grammars
from jaxllm.serve.engine import Engine
from jaxllm.serve.generation import Delta, Generation, Limits, Request, RequestError, RequestFailed, Unavailable
from jaxllm.serve.guards import DenyList, RateLimiter
from jaxllm.serve.metrics import Metrics
from jaxllm.serve.settings import ServeConfig

log = logging.getLogger("jaxllm.serve")
NAME_SHOWN = 64  # characters of a client's model name repeated in a refusal
UPPER_BOUNDS = ("less_than", "less_than_equal", "too_long")  # pydantic's error types


@dataclasses.dataclass
class Server:
    """`engine` is None until it has compiled every step; `compiled` says how far it is: (steps
    compiled, steps in all)."""

    settings: ServeConfig
    limits: Limits
    model_name: str
    tokenizer: Tokenizer
    chat: ChatTemplate
    deny: DenyList
    api_keys: frozenset[str]
    metrics: Metrics
    engine: Engine | None = None
    compiled: tuple[int, int] = (0, 0)

    def __post_init__(self):
        self.grammars = Grammars(self.tokenizer)
        self.limiter = RateLimiter(self.settings.rate_per_s, self.settings.burst)
        self.completion_body, self.chat_body = protocol.request_models(self.limits, self.model_name)
        self.tokenize_text_body, self.tokenize_chat_body, self.detokenize_body = protocol.tokenize_models(
            self.limits, self.model_name
        )

    def admit(self, headers, client: str) -> None:
        """The API key (if keys are set), then the token bucket of the key or client address.
        A client without a valid key learns nothing of the server, and its failures are
        rate-limited by its address."""
        key = None
        if self.api_keys:
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.strip(), k) for k in self.api_keys):
                if wait := self.limiter.take(f"unauthenticated {client}"):
                    raise ApiError(429, f"too many requests; retry in {wait} s", "rate_limited", "rate_limit_exceeded",
                                   retry_after=wait)  # fmt: skip
                raise ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'", "auth",
                               "invalid_api_key")  # fmt: skip
        wait = self.limiter.take(key or client)
        if wait:
            raise ApiError(
                429, f"too many requests: this key may send {self.settings.rate_per_s:g} per second, "
                f"{self.settings.burst} at once (serve.rate_per_s, serve.burst); retry in {wait} s",
                "rate_limited", "rate_limit_exceeded", retry_after=wait,
            )  # fmt: skip

    def ready(self) -> Engine:
        if self.engine is None:
            done, total = self.compiled
            raise ApiError(503, f"the server is starting ({done} of {total} steps compiled); retry shortly",
                           "unavailable", retry_after=5)  # fmt: skip
        if self.engine.failure is not None:
            raise ApiError(503, f"the engine has stopped ({self.engine.failure!r}); restart the server", "unavailable")
        return self.engine

    async def parse(
        self, request: HttpRequest, schema: type[BaseModel] | Callable[[dict], type[BaseModel]], invalid: int = 422
    ) -> BaseModel:
        """The body as `schema` (or as the schema it picks for the JSON body's fields): JSON (400),
        then fields this server cannot honour, then every field's type and bound (`invalid`: 422,
        or 400 on vLLM's routes, as vLLM answers), then the model's name (404)."""
        timeout = self.settings.body_timeout_s
        try:
            raw = await asyncio.wait_for(request.body(), timeout)
        except TimeoutError as e:
            raise ApiError(408, f"the body did not arrive within {timeout:g} s (serve.body_timeout_s); send it "
                           "at once", "body_timeout", "timeout") from e  # fmt: skip
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad UTF-8 and over-long integers are ValueErrors too
            raise ApiError(400, f"the body is not JSON ({e}); send a JSON object", "bad_json", "invalid_json") from e
        if not isinstance(body, dict):
            raise ApiError(invalid, f"the body is a JSON {type(body).__name__}; send a JSON object", "invalid")
        try:
            protocol.unsupported(body)
            parsed = (schema if isinstance(schema, type) else schema(body)).model_validate(body)
        except RequestError as e:
            refusal = ApiError.of(e)
            if refusal.status == 422:  # a field's
                refusal.status = invalid
            raise refusal from e
        except ValidationError as e:
            error = e.errors()[0]  # its location, less pydantic's names of the types and forms it tried
            param = ".".join(str(p) for p in error["loc"] if isinstance(p, int) or p.isidentifier() and p != "str")
            bound = protocol.BOUNDS.get(str(error["loc"][0])) if error["type"] in UPPER_BOUNDS else None
            message = f"{param}: {error['msg']}" + (f" ({bound})" if bound else "")
            raise ApiError(invalid, message, "invalid", "invalid_value", param) from e
        if parsed.model != self.model_name:
            shown = parsed.model if len(parsed.model) <= NAME_SHOWN else parsed.model[:NAME_SHOWN] + "…"
            raise ApiError(404, f"model {shown!r} is not served here; this server serves {self.model_name!r}",
                           "unknown_model", "model_not_found", "model")  # fmt: skip
        return parsed

    async def constraint(self, body: protocol._Sampling) -> Constraint | None:
        """The grammar `body`'s structured-output fields ask for, checked (in a worker thread: a
        large schema takes a while); one that cannot be used is a 400 naming the field."""
        try:
            return await run_in_threadpool(structured.constraint, self.grammars, body)
        except RequestError as e:
            raise ApiError.of(e) from e

    async def text_prompts(self, texts: list[str], special: bool = True) -> list[list[int]]:
        """Text prompts tokenized (in a worker thread) as the model's tokenizer starts a prompt:
        its `prompt_prefix` (a Llama's bos; not if `special` is false), then the text's tokens."""
        encoded = await run_in_threadpool(self.tokenizer.encode_batch, texts) if texts else []
        prefix = list(self.tokenizer.prompt_prefix) if special else []
        return [prefix + ids for ids in encoded]

    async def chat_prompt(
        self, messages: list[protocol.Message], add_generation_prompt: bool = True, tools: list | None = None
    ) -> list[int]:
        """A chat's prompt: its messages (and `tools`, as OpenAI's request gives them) rendered by
        the chat template and tokenized (in a worker thread) as the chat data format is in
        training, special tokens' text read as those tokens. A template's refusal is about these
        messages: a 422."""
        turns = [m.turn() for m in messages]
        tools = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        try:
            return await run_in_threadpool(
                lambda: self.tokenizer.encode_special(self.chat.render(turns, add_generation_prompt, tools))
            )
        except ChatTemplateError as e:
            raise ApiError.of(RequestError(str(e), "invalid_messages", "messages")) from e

    def submit(self, engine: Engine, requests: list[Request], texts: list[str | None], request_id: str):
        """The engine's limits, the deny-list (on each request's text, or its tokens' if it came as
        tokens), then the queue: all of a request's prompts or none."""
        try:
            for r in requests:
                engine.limits.check(r)
        except RequestError as e:
            raise ApiError.of(e) from e
        for r, text in zip(requests, texts, strict=True):
            if pattern := self.deny.match(self.tokenizer.decode(r.prompt) if text is None else text):
                log.warning("deny-list: request %s matched %r", request_id, pattern)
                raise ApiError(400, "the request was refused by this server's content policy", "deny_list",
                               "content_policy_violation", "prompt")  # fmt: skip
        loop, generations = asyncio.get_running_loop(), []
        try:
            generations += [engine.submit(r, loop, request_id) for r in requests]
        except Unavailable as e:
            for g in generations:
                g.cancel()
            raise ApiError(503, f"{e}; retry shortly", "queue_full", "queue_full", retry_after=1) from e
        self.metrics.prompt_tokens.inc(sum(len(r.prompt) for r in requests))
        return generations

    async def started(self, request_id: str, generations: list[Generation]) -> list[AsyncIterator[Delta]]:
        """Each generation's deltas, once every prompt is prefilled and has passed the alarm."""
        streams = []
        try:
            for g in generations:
                deltas = aiter(g)
                first = await anext(deltas, None)
                self._judged(request_id, g)
                if g.error is not None:
                    raise g.error
                streams.append(chain(first, deltas))
        except (RequestError, RequestFailed, Unavailable, TimeoutError) as e:
            raise ApiError.of(e).about(request_id) from e
        finally:
            if len(streams) < len(generations):
                for g in generations:
                    g.cancel()
        return streams

    def _judged(self, request_id: str, g: Generation) -> None:
        if g.perplexity is None:
            return
        self.metrics.prompt_perplexity.observe(max(g.perplexity))
        if g.alarm:
            self.metrics.perplexity_alarms.inc()
            log.warning(
                "perplexity alarm: request %s, prompt perplexity %.1f whole, %.1f in its worst 32-token window "
                "(serve.ppl_alarm=%g)%s", request_id, *g.perplexity, self.settings.ppl_alarm,
                ", refused" if self.settings.ppl_reject else "",
            )  # fmt: skip

    def count(self, e: ApiError) -> None:
        """A request not served, by reason: a failure (500, 504) or a refusal."""
        (self.metrics.failures if e.status in FAILURES else self.metrics.rejections).labels(e.reason).inc()

    def finished(self, generations: list[Generation]) -> None:
        """Latency and token metrics of requests that ran to their end."""
        m = self.metrics
        for g in generations:
            if g.scheduled_at is not None:
                m.queued(g.scheduled_at - g.submitted)
            if g.first_token_at is not None:
                m.first_token(g.first_token_at - g.submitted)
            for stream in g.streams:
                m.generated_tokens.inc(len(stream.tokens))
                if g.finished_at is not None and len(stream.tokens) > 1:
                    m.decoded(len(stream.tokens), g.finished_at - g.first_token_at)

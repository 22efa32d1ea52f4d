"""The HTTP API of `python -m jaxllm.serve`: OpenAI's completions and chat completions (streamed
as server-sent events or whole), the model list, health and Prometheus metrics.

Every `/v1` request passes the guards in order: body size (413), API key (401), the key's token
bucket (429), JSON (400), fields (422), model (404), the engine's limits (422), the deny-list
(400) and a full queue (503); after the prefill, the perplexity alarm (400 if it refuses). Each
refusal has OpenAI's error body and is counted by reason. The engine steps in a thread of its
own; a request's tokens reach its handler on the event loop as they are decoded. Tokenizing runs
in worker threads, so a long prompt does not hold up the other streams."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator

import ml_collections
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.serve import protocol
from jaxllm.serve.aio import ClientGone, chain, drain, merged, unless_gone
from jaxllm.serve.chat import ChatTemplate
from jaxllm.serve.engine import Delta, Engine, Generation, Request, RequestError, Unavailable
from jaxllm.serve.guards import DenyList, RateLimiter
from jaxllm.serve.metrics import Metrics
from jaxllm.serve.middleware import CountRequests, LimitBody

log = logging.getLogger("jaxllm.serve")

ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ApiError(Exception):
    """A refusal: its status, OpenAI's error fields, and the reason it is counted under."""

    def __init__(self, status: int, message: str, reason: str, code=None, param=None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.reason, self.code, self.param = status, message, reason, code, param
        self.headers = {} if retry_after is None else {"Retry-After": str(retry_after)}

    @classmethod
    def from_request_error(cls, e: RequestError) -> ApiError:
        status, reason = {
            "context_length_exceeded": (422, "context_length"),
            "perplexity_alarm": (400, "perplexity"),
            "unsupported_field": (422, "unsupported_field"),
        }.get(e.code, (422, "invalid"))
        return cls(status, str(e), reason, e.code or "invalid_value", e.param)

    def about(self, request_id: str) -> ApiError:
        self.headers["X-Request-Id"] = request_id
        return self

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                 "param": self.param, "code": self.code}  # fmt: skip
        return JSONResponse({"error": error}, self.status, self.headers)


@dataclasses.dataclass
class Server:
    """What the routes share. `engine` is None until it has compiled every step."""

    settings: ml_collections.ConfigDict  # cfg.serve
    model_name: str
    tokenizer: Tokenizer
    chat: ChatTemplate
    deny: DenyList
    api_keys: frozenset[str]
    metrics: Metrics
    engine: Engine | None = None

    def __post_init__(self):
        self.limiter = RateLimiter(self.settings.rate_per_s, self.settings.burst)

    def admit(self, request: HttpRequest) -> None:
        """The API key (if keys are set), then the token bucket of the key or client address."""
        key = None
        if self.api_keys:
            scheme, _, key = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.strip(), k) for k in self.api_keys):
                raise ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'", "auth",
                               "invalid_api_key")  # fmt: skip
        wait = self.limiter.take(key or (request.client.host if request.client else ""))
        if wait:
            raise ApiError(
                429, f"too many requests: this key may send {self.settings.rate_per_s:g} per second, "
                f"{self.settings.burst} at once (serve.rate_per_s, serve.burst); retry in {wait} s",
                "rate_limited", "rate_limit_exceeded", retry_after=wait,
            )  # fmt: skip

    def ready(self) -> Engine:
        if self.engine is None:
            raise ApiError(503, "the model is still compiling; retry shortly", "unavailable", retry_after=5)
        if self.engine.failure is not None:
            raise ApiError(503, f"the engine has stopped ({self.engine.failure!r}); restart the server", "unavailable")
        return self.engine

    async def parse(self, request: HttpRequest, schema: type[BaseModel]) -> BaseModel:
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as e:  # bad UTF-8 is a ValueError too
            raise ApiError(400, f"the body is not JSON ({e}); send a JSON object", "bad_json", "invalid_json") from e
        if not isinstance(body, dict):
            raise ApiError(422, f"the body is a JSON {type(body).__name__}; send a JSON object", "invalid")
        try:
            protocol.unsupported(body)
            parsed = schema.model_validate(body)
        except RequestError as e:
            raise ApiError.from_request_error(e) from e
        except ValidationError as e:
            error = e.errors()[0]  # its location, less pydantic's names of the types it tried
            param = ".".join(str(p) for p in error["loc"] if isinstance(p, int) or p.isidentifier() and p != "str")
            raise ApiError(422, f"{param}: {error['msg']}", "invalid", "invalid_value", param) from e
        if parsed.model != self.model_name:
            raise ApiError(404, f"model {parsed.model!r} is not served here; this server serves {self.model_name!r}",
                           "unknown_model", "model_not_found", "model")  # fmt: skip
        return parsed

    def submit(self, engine: Engine, requests: list[Request], texts: list[str | None]) -> list[Generation]:
        """The engine's limits, the deny-list (on each request's text, or its tokens' if it came as
        tokens), then the queue: all of a request's prompts or none."""
        try:
            for r in requests:
                engine.check(r)
        except RequestError as e:
            raise ApiError.from_request_error(e) from e
        for r, text in zip(requests, texts, strict=True):
            if pattern := self.deny.match(self.tokenizer.decode(r.prompt) if text is None else text):
                log.warning("deny-list: a request matched %r", pattern)
                raise ApiError(400, "the request was refused by this server's content policy", "deny_list",
                               "content_policy_violation", "prompt")  # fmt: skip
        loop, generations = asyncio.get_running_loop(), []
        try:
            generations += [engine.submit(r, loop) for r in requests]
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
        except RequestError as e:
            raise ApiError.from_request_error(e).about(request_id) from e
        except Unavailable as e:
            raise ApiError(503, f"{e}; restart the server", "unavailable").about(request_id) from e
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

    def finished(self, generations: list[Generation]) -> None:
        """Latency and token metrics of requests that ran to their end."""
        m = self.metrics
        for g in generations:
            if g.first_token_at is not None:
                m.time_to_first_token.observe(g.first_token_at - g.submitted)
            for stream in g.streams:
                m.generated_tokens.inc(len(stream.tokens))
                if g.finished_at is not None and len(stream.tokens) > 1:
                    m.time_per_output_token.observe((g.finished_at - g.first_token_at) / (len(stream.tokens) - 1))


def _max_tokens(asked: int | None, engine: Engine, prompt: list[int]) -> int:
    """What a request asked for; if nothing, as many as its slot holds."""
    return engine.max_len - len(prompt) if asked is None else asked


@dataclasses.dataclass
class _Job:
    """One HTTP request's generations, and how its API shapes what they produce."""

    id: str
    kind: str  # OpenAI's object name of the whole response
    api: _Completions | _Chat
    generations: list[Generation]
    include_usage: bool

    def choice_index(self, generation: int, choice: int) -> int:
        return generation * self.generations[0].request.n + choice

    def usage(self) -> dict:
        prompt = sum(len(g.request.prompt) for g in self.generations)
        return protocol.usage(prompt, sum(len(s.tokens) for g in self.generations for s in g.streams))


class _Completions:
    def __init__(self, server: Server, body: protocol.CompletionRequest):
        self.server, self.body = server, body

    def _echo(self, g: Generation) -> str:
        return self.server.tokenizer.decode(g.request.prompt) if self.body.echo else ""

    def _logprobs(self, g: Generation, logprobs, offset: int, echo: bool):
        if self.body.logprobs is None:
            return None
        tokenizer, top = self.server.tokenizer, self.body.logprobs
        scored = protocol.prompt_logprobs(g.request.prompt, g.prompt_logprobs, top) if echo else []
        return protocol.completion_logprobs(tokenizer, scored + logprobs, top, offset)

    def choice(self, g: Generation, index: int, choice) -> dict:
        return {"index": index, "text": self._echo(g) + choice.text, "finish_reason": choice.finish_reason,
                "logprobs": self._logprobs(g, choice.logprobs, 0, self.body.echo)}  # fmt: skip

    def opening(self, g: Generation, index: int) -> dict | None:
        if not self.body.echo:
            return None
        return {"index": index, "text": self._echo(g), "finish_reason": None,
                "logprobs": self._logprobs(g, [], 0, True)}  # fmt: skip

    def chunk(self, g: Generation, index: int, delta: Delta, offset: int) -> dict:
        return {"index": index, "text": delta.text, "finish_reason": delta.finish_reason,
                "logprobs": self._logprobs(g, delta.logprobs, offset, False)}  # fmt: skip


class _Chat:
    def __init__(self, server: Server, body: protocol.ChatRequest):
        self.server, self.body = server, body
        self.top = (body.top_logprobs or 0) if body.logprobs else None

    def _logprobs(self, logprobs) -> dict | None:
        return None if self.top is None else protocol.chat_logprobs(self.server.tokenizer, logprobs, self.top)

    def choice(self, g: Generation, index: int, choice) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": choice.text},
                "finish_reason": choice.finish_reason, "logprobs": self._logprobs(choice.logprobs)}  # fmt: skip

    def opening(self, g: Generation, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}

    def chunk(self, g: Generation, index: int, delta: Delta, offset: int) -> dict:
        content = {"content": delta.text} if delta.text else {}
        return {"index": index, "delta": content, "finish_reason": delta.finish_reason,
                "logprobs": self._logprobs(delta.logprobs)}  # fmt: skip


async def _respond(server: Server, request: HttpRequest, job: _Job, stream: bool) -> Response:
    """The response, streamed or whole. A client that leaves before its stream starts, or before
    its whole response is ready, frees its slots (and queue places) at once."""
    try:
        streams = await unless_gone(request, server.started(job.id, job.generations))
        if not stream:
            await unless_gone(request, drain(streams))
    except ClientGone:
        for g in job.generations:
            g.cancel()
        return Response(status_code=499)  # nginx's "client closed request", for the metrics only
    model = server.model_name
    if not stream:
        server.finished(job.generations)
        choices = [
            job.api.choice(g, job.choice_index(i, c), choice)
            for i, g in enumerate(job.generations)
            for c, choice in enumerate(g.choices())
        ]
        body = protocol.envelope(job.id, job.kind, model, choices, usage=job.usage())
        return JSONResponse(body, headers={"X-Request-Id": job.id})

    chunk_kind = f"{job.kind}.chunk" if job.kind == "chat.completion" else job.kind

    def event(choices: list[dict], **extra) -> bytes:
        body = protocol.envelope(job.id, chunk_kind, model, choices, **extra)
        return format_sse_event(data_str=json.dumps(body, ensure_ascii=False))

    async def events() -> AsyncIterator[bytes]:
        offsets: dict[int, int] = {}
        try:
            for i, g in enumerate(job.generations):
                for c in range(g.request.n):
                    if opening := job.api.opening(g, job.choice_index(i, c)):
                        offsets[job.choice_index(i, c)] = len(opening.get("text", ""))
                        yield event([opening])
            async for i, delta in merged(streams):
                index = job.choice_index(i, delta.choice)
                if delta.text or delta.finish_reason or delta.logprobs:
                    yield event([job.api.chunk(job.generations[i], index, delta, offsets.get(index, 0))])
                offsets[index] = offsets.get(index, 0) + len(delta.text)
            if job.include_usage:
                yield event([], usage=job.usage())
            yield b"data: [DONE]\n\n"
        finally:  # also when the client went away: its slots are freed at the engine's next step
            for g in job.generations:
                g.cancel()
            server.finished(job.generations)

    return EventSourceResponse(events(), headers={"X-Request-Id": job.id, "Cache-Control": "no-cache"})


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="jaxllm", docs_url=None, redoc_url=None)
    metrics = server.metrics

    def refused(e: ApiError) -> JSONResponse:
        metrics.rejections.labels(e.reason).inc()
        return e.response()

    limit = server.settings.max_body_bytes

    def too_large() -> ApiError:
        message = f"the body is over {limit} bytes (serve.max_body_bytes); send less"
        return ApiError(413, message, "body_too_large", "request_too_large")

    app.add_middleware(LimitBody, limit=limit, too_large=too_large, refused=refused)
    app.add_middleware(CountRequests, metrics=metrics, routes=ROUTES)  # added last: outermost, counts every answer
    app.add_exception_handler(ApiError, lambda request, e: refused(e))

    @app.exception_handler(HTTPException)
    async def no_route(request: HttpRequest, e: HTTPException) -> JSONResponse:
        return refused(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", "no_route"))

    @app.get("/health")
    def health() -> JSONResponse:
        engine = server.engine
        if engine is None:
            return JSONResponse({"status": "compiling"}, 503)
        if engine.failure is not None:
            return JSONResponse({"status": "stopped", "error": repr(engine.failure)}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def prometheus() -> Response:
        engine = server.engine
        ready = engine is not None and engine.failure is None
        metrics.engine_up.set(ready)
        if engine is not None:
            metrics.queue_depth.set(engine.queued())
            metrics.active_slots.set(engine.active_slots())
            metrics.kv_cache_usage.set(engine.cache_usage())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models(request: HttpRequest) -> dict:
        server.admit(request)
        model = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "jaxllm",
                 "max_model_len": server.settings.max_len}  # fmt: skip
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        server.admit(request)
        body = await server.parse(request, protocol.CompletionRequest)
        engine = server.ready()
        prompts = body.prompts
        if not 1 <= len(prompts) <= engine.slots:
            raise ApiError(422, f"{len(prompts)} prompts given; send 1 to {engine.slots} (serve.slots) per request",
                           "invalid", "invalid_value", "prompt")  # fmt: skip
        if body.echo and body.logprobs is not None and not server.settings.prompt_nll:
            raise ApiError(422, "echo with logprobs needs the prompt's log-probs: start the server with "
                           "--config.serve.prompt_nll=true", "invalid", "invalid_value", "echo")  # fmt: skip
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await run_in_threadpool(server.tokenizer.encode_batch, texts) if texts else [])
        prefix = list(server.tokenizer.prompt_prefix)  # a text prompt starts as the model's tokenizer starts one
        ids = [prefix + next(encoded) if isinstance(p, str) else p for p in prompts]
        requests = [body.request(p, _max_tokens(body.max_tokens, engine, p), body.logprobs) for p in ids]
        generations = server.submit(engine, requests, [p if isinstance(p, str) else None for p in prompts])
        api = _Completions(server, body)
        job = _Job(f"cmpl-{uuid.uuid4().hex}", "text_completion", api, generations, body.include_usage)
        return await _respond(server, request, job, body.stream)

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest) -> Response:
        server.admit(request)
        body = await server.parse(request, protocol.ChatRequest)
        engine = server.ready()
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        try:
            prompt = await run_in_threadpool(lambda: server.tokenizer.encode(server.chat.render(messages)))
        except RequestError as e:
            raise ApiError.from_request_error(e) from e
        limit = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        request = body.request(prompt, _max_tokens(limit, engine, prompt), logprobs)
        generations = server.submit(engine, [request], ["\n".join(m["content"] for m in messages)])
        job = _Job(
            f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", _Chat(server, body), generations, body.include_usage
        )
        return await _respond(server, request, job, body.stream)

    return app

"""The HTTP API of `python -m jaxllm.serve`: OpenAI's completions and chat completions (streamed
as server-sent events or whole), vLLM's /tokenize and /detokenize, the model list, health,
Prometheus metrics and an OpenAPI document that declares every request body, bound and answer.

Every request but /health and /metrics passes the guards in order: API key (401), the key's token
bucket (429), body size (413), a body that arrives in time (408), JSON (400), fields the server
cannot honour, then every field's type and bound (422), model (404), the engine's context limits
(422), the deny-list (400) and a full queue (503); after the prefill, the perplexity alarm (400 if
it refuses). /tokenize and /detokenize pass the same guards up to the model's name, and refuse
a field's type or bound with a 400, as vLLM does; they need no engine, only the tokenizer. Each
refusal has OpenAI's error body and is counted by reason. Anything else raised
while serving a request ends that request alone with a 500 that names it. The engine steps in a
thread of its own; a request's tokens reach its handler on the event loop as they are decoded.
Tokenizing runs in worker threads, so a long prompt does not hold up the other streams."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

import jaxllm
from jaxllm.serve import protocol, shapes
from jaxllm.serve.api_error import ApiError
from jaxllm.serve.middleware import Admit, CountRequests, LimitBody
from jaxllm.serve.responses import Chat, Completions, Job, respond
from jaxllm.serve.server import Server

log = logging.getLogger("jaxllm.serve")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models", "/health", "/metrics")
OPEN = ("/health", "/metrics")  # no API key needed
REFUSALS = {
    400: "not JSON, the deny-list, the perplexity alarm, or a field of /tokenize or /detokenize",
    401: "no valid API key", 404: "an unknown model",
    408: "the body came too slowly (serve.body_timeout_s)", 413: "the body is over serve.max_body_bytes",
    422: "a field's type or bound, an unsupported field, over the context, or the chat template's refusal",
    429: "the rate limit",
    500: "the engine failed this request (others go on)", 503: "the queue is full, or the engine is not ready",
    504: "past the request's deadline (serve.request_timeout_s)",
}  # fmt: skip


# One server-sent event of a stream: `data` holds a chunk's JSON, an error's, or `[DONE]` last.
EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


# vLLM's routes: no stream, no engine (so no 503), and no context limit (so no 422 but the template's).
TOKENIZE_REFUSALS = (400, 401, 404, 408, 413, 422, 429, 500)
DETOKENIZE_REFUSALS = (400, 401, 404, 408, 413, 429, 500)


def _answers(body: type | None, statuses=tuple(REFUSALS), events: bool = True) -> dict:
    """The OpenAPI `responses` of a route: `body` (also as server-sent events, if `events`) and
    the refusals."""
    stream = {"content": {"text/event-stream": {"schema": EVENT}}} if events else {}
    ok = {} if body is None else {200: {"model": body, **stream}}
    return ok | {s: {"model": shapes.ErrorResponse, "description": REFUSALS[s]} for s in statuses}


def _takes(*schemas: str) -> dict:
    """A route's request body (any of `schemas`: unknown fields are ignored, so a body may fit
    more than one), for the document: the routes parse it themselves, after the key."""
    refs = [{"$ref": f"#/components/schemas/{s}"} for s in schemas]
    content = {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}
    return {"requestBody": {"required": True, "content": content}}


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="jaxllm", version=jaxllm.__version__, docs_url=None, redoc_url=None)
    metrics = server.metrics

    def refused(e: ApiError) -> JSONResponse:
        server.count(e)
        return e.response()

    limit = server.settings.max_body_bytes

    def too_large() -> ApiError:
        message = f"the body is over {limit} bytes (serve.max_body_bytes); send less"
        return ApiError(413, message, "body_too_large", "request_too_large")

    # Added innermost first: the count sees every answer, the key is checked before the body is read.
    app.add_middleware(LimitBody, limit=limit, too_large=too_large, refused=refused)
    app.add_middleware(Admit, admit=server.admit, refused=refused, open=OPEN, refusal=ApiError)
    app.add_middleware(CountRequests, metrics=metrics, routes=ROUTES)
    app.add_exception_handler(ApiError, lambda request, e: refused(e))
    app.add_exception_handler(ClientDisconnect, lambda request, e: Response(status_code=499))

    @app.exception_handler(HTTPException)
    async def no_route(request: HttpRequest, e: HTTPException) -> JSONResponse:
        return refused(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", "no_route"))

    @app.exception_handler(Exception)
    async def failed(request: HttpRequest, e: Exception) -> JSONResponse:
        request_id = f"req-{uuid.uuid4().hex}"
        log.error("request %s (%s %s) failed", request_id, request.method, request.url.path, exc_info=e)
        message = f"request {request_id} failed ({type(e).__name__}); the server's log has why"
        return refused(ApiError(500, message, "internal_error", "internal_error").about(request_id))

    @app.get("/health", responses={503: {"description": "starting (loading and compiling), or the engine has stopped"}})
    def health() -> JSONResponse:
        engine = server.engine
        if engine is None:
            done, total = server.compiled
            return JSONResponse({"status": "starting", "compiled": done, "steps": total}, 503)
        if engine.failure is not None:
            return JSONResponse({"status": "stopped", "error": repr(engine.failure)}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    def prometheus() -> Response:
        engine = server.engine
        metrics.engine_up.set(engine is not None and engine.failure is None)
        if engine is not None:
            metrics.engine(engine.stats())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=shapes.ModelList, responses=_answers(None, (401, 429)))
    def models() -> dict:
        model = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "jaxllm",
                 "max_model_len": server.settings.max_len}  # fmt: skip
        return {"object": "list", "data": [model]}

    @app.post(
        "/v1/completions", openapi_extra=_takes("CompletionRequest"), responses=_answers(shapes.CompletionResponse)
    )
    async def completions(http: HttpRequest) -> Response:
        body = await server.parse(http, server.completion_body)
        engine = server.ready()
        if body.echo and body.logprobs is not None and not server.settings.prompt_nll:
            raise ApiError(422, "echo with logprobs needs the prompt's log-probs: start the server with "
                           "--config.serve.prompt_nll=true", "invalid", "invalid_value", "echo")  # fmt: skip
        prompts = body.prompts
        encoded = iter(await server.text_prompts([p for p in prompts if isinstance(p, str)]))
        ids = [next(encoded) if isinstance(p, str) else p for p in prompts]
        constraint = await server.constraint(body)
        requests = [
            body.request(p, _max_tokens(body.max_tokens, engine.max_len, p), body.logprobs, constraint) for p in ids
        ]
        job_id = f"cmpl-{uuid.uuid4().hex}"
        generations = server.submit(engine, requests, [p if isinstance(p, str) else None for p in prompts], job_id)
        job = Job(job_id, "text_completion", Completions(server, body), generations, body.include_usage)
        return await respond(server, http, job, body.stream)

    @app.post("/v1/chat/completions", openapi_extra=_takes("ChatRequest"),
              responses=_answers(shapes.ChatCompletionResponse))  # fmt: skip
    async def chat(http: HttpRequest) -> Response:
        body = await server.parse(http, server.chat_body)
        engine = server.ready()
        prompt = await server.chat_prompt(body.messages, tools=body.tools)
        constraint = await server.constraint(body)
        limit = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        request = body.request(prompt, _max_tokens(limit, engine.max_len, prompt), logprobs, constraint)
        job_id = f"chatcmpl-{uuid.uuid4().hex}"
        generations = server.submit(engine, [request], ["\n".join(m.text for m in body.messages)], job_id)
        job = Job(job_id, "chat.completion", Chat(server, body), generations, body.include_usage)
        return await respond(server, http, job, body.stream)

    @app.post("/tokenize", openapi_extra=_takes("TokenizeCompletionRequest", "TokenizeChatRequest"),
              responses=_answers(shapes.TokenizeResponse, TOKENIZE_REFUSALS, events=False))  # fmt: skip
    async def tokenize(http: HttpRequest) -> JSONResponse:
        """vLLM's: a text prompt's ids as a completion's (any length), or a chat's as a chat
        completion's (`messages`), with their count and the context's length."""
        text, chat = server.tokenize_text_body, server.tokenize_chat_body
        body = await server.parse(http, lambda fields: chat if "messages" in fields else text, invalid=400)
        if isinstance(body, protocol.TokenizeChatRequest):
            ids = await server.chat_prompt(body.messages, body.add_generation_prompt, body.tools)
            ids = (list(server.tokenizer.prompt_prefix) if body.add_special_tokens else []) + ids
        else:
            (ids,) = await server.text_prompts([body.prompt], body.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": server.settings.max_len})

    @app.post("/detokenize", openapi_extra=_takes("DetokenizeRequest"),
              responses=_answers(shapes.DetokenizeResponse, DETOKENIZE_REFUSALS, events=False))  # fmt: skip
    async def detokenize(http: HttpRequest) -> JSONResponse:
        """vLLM's: the text of token ids, each in the vocabulary."""
        body = await server.parse(http, server.detokenize_body, invalid=400)
        return JSONResponse({"prompt": await run_in_threadpool(server.tokenizer.decode, body.tokens)})

    _document(app, [server.completion_body, server.chat_body, server.tokenize_text_body, server.tokenize_chat_body,
                    server.detokenize_body])  # fmt: skip
    return app


def _max_tokens(asked: int | None, max_len: int, prompt: list[int]) -> int:
    """What a request asked for; if nothing, as many as its slot holds (at least one: a prompt
    that fills the slot is then refused for its length)."""
    return max(1, max_len - len(prompt)) if asked is None else asked


def _document(app: FastAPI, bodies: list[type]) -> None:
    """The OpenAPI document, with the request bodies the routes parse themselves among its schemas."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema(
                [(b, "validation") for b in bodies], ref_template="#/components/schemas/{model}"
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

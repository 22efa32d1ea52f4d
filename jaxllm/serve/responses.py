"""One HTTP request's generations as OpenAI's response: whole, or streamed as server-sent events.

A client that leaves before its response is whole frees its slots (and queue places) at once. A
request the engine fails, or that runs past its deadline, ends alone: before its stream starts
with a 500 or 504, after with an error event, each with OpenAI's error body and its request id."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event

from jaxllm.serve import protocol, shapes, structured
from jaxllm.serve.aio import ClientGone, drain, merged, unless_gone
from jaxllm.serve.api_error import ApiError
from jaxllm.serve.generation import Delta, Generation, RequestFailed
from jaxllm.serve.server import Server

log = logging.getLogger("jaxllm.serve")


class Completions:
    def __init__(self, server: Server, body: protocol.CompletionRequest):
        self.server, self.body = server, body

    def _echo(self, g: Generation) -> str:
        return self.server.tokenizer.decode(g.request.prompt) if self.body.echo else ""

    def _logprobs(self, g: Generation, logprobs, offset: int, echo: bool):
        if self.body.logprobs is None:
            return None
        tokenizer, top = self.server.tokenizer, self.body.logprobs
        scored = shapes.prompt_logprobs(g.request.prompt, g.prompt_logprobs, top) if echo else []
        return shapes.completion_logprobs(tokenizer, scored + logprobs, top, offset)

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


class Chat:
    """A chat's choices; with tools, an output that is a whole array of calls is answered as
    `tool_calls` (streamed: held back from its first `[` and sent whole at its end, as one delta
    per call with its index, id, name and arguments, which OpenAI's client assembles)."""

    def __init__(self, server: Server, body: protocol.ChatRequest):
        self.server, self.body = server, body
        self.top = (body.top_logprobs or 0) if body.logprobs else None
        self.calls = structured.Calls(body)
        self._held: dict[int, str] = {}  # by choice index: streamed text that may be calls

    def _logprobs(self, logprobs) -> dict | None:
        return None if self.top is None else shapes.chat_logprobs(self.server.tokenizer, logprobs, self.top)

    def choice(self, g: Generation, index: int, choice) -> dict:
        calls = self.calls.read(choice.text)
        message = {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
            {"role": "assistant", "content": choice.text}  # fmt: skip
        return {"index": index, "message": message, "finish_reason": "tool_calls" if calls else choice.finish_reason,
                "logprobs": self._logprobs(choice.logprobs)}  # fmt: skip

    def opening(self, g: Generation, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}

    def chunk(self, g: Generation, index: int, delta: Delta, offset: int) -> dict:
        text, finish = delta.text, delta.finish_reason
        content = {"content": text} if text else {}
        if self.calls.active and (index in self._held or (offset == 0 and text.startswith("["))):
            self._held[index] = self._held.get(index, "") + text
            content = {}
            if finish is not None:
                held = self._held.pop(index)
                calls = self.calls.read(held)
                content = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]} if calls else \
                    {"content": held}  # fmt: skip
                finish = "tool_calls" if calls else finish
        return {"index": index, "delta": content, "finish_reason": finish, "logprobs": self._logprobs(delta.logprobs)}


@dataclasses.dataclass
class Job:
    """One HTTP request's generations, and how its API shapes what they produce."""

    id: str
    kind: str  # OpenAI's object name of the whole response
    api: Completions | Chat
    generations: list[Generation]
    include_usage: bool

    def choice_index(self, generation: int, choice: int) -> int:
        return generation * self.generations[0].request.n + choice

    def usage(self) -> dict:
        prompt = sum(len(g.request.prompt) for g in self.generations)
        return shapes.usage(prompt, sum(len(s.tokens) for g in self.generations for s in g.streams))

    def failure(self) -> ApiError | None:
        """Why the job ended without its choices, if it did."""
        error = next((g.error for g in self.generations if g.error is not None), None)
        return None if error is None else ApiError.of(error).about(self.id)

    def cancel(self) -> None:
        for g in self.generations:
            g.cancel()


async def respond(server: Server, http: HttpRequest, job: Job, stream: bool) -> Response:
    """The response, streamed or whole."""
    try:
        streams = await unless_gone(http, server.started(job.id, job.generations))
        if not stream:
            await unless_gone(http, drain(streams))
    except ClientGone:
        job.cancel()
        return Response(status_code=499)  # nginx's "client closed request", for the metrics only
    except (RequestFailed, TimeoutError) as e:
        job.cancel()
        raise ApiError.of(e).about(job.id) from e
    if not stream:
        if failure := job.failure():
            raise failure
        server.finished(job.generations)
        choices = [
            job.api.choice(g, job.choice_index(i, c), choice)
            for i, g in enumerate(job.generations)
            for c, choice in enumerate(g.choices())
        ]
        body = shapes.envelope(job.id, job.kind, server.model_name, choices, usage=job.usage())
        return JSONResponse(body, headers={"X-Request-Id": job.id})
    return EventSourceResponse(
        _events(server, job, streams), headers={"X-Request-Id": job.id, "Cache-Control": "no-cache"}
    )


async def _events(server: Server, job: Job, streams: list[AsyncIterator[Delta]]) -> AsyncIterator[bytes]:
    chunk_kind = f"{job.kind}.chunk" if job.kind == "chat.completion" else job.kind

    def event(body: dict) -> bytes:
        return format_sse_event(data_str=json.dumps(body, ensure_ascii=False))

    def chunk(choices: list[dict], **extra) -> bytes:
        return event(shapes.envelope(job.id, chunk_kind, server.model_name, choices, **extra))

    offsets: dict[int, int] = {}
    try:
        for i, g in enumerate(job.generations):
            for c in range(g.request.n):
                if opening := job.api.opening(g, job.choice_index(i, c)):
                    offsets[job.choice_index(i, c)] = len(opening.get("text", ""))
                    yield chunk([opening])
        async for i, delta in merged(streams):
            index = job.choice_index(i, delta.choice)
            if delta.text or delta.finish_reason or delta.logprobs:
                body = job.api.chunk(job.generations[i], index, delta, offsets.get(index, 0))
                if body.get("delta", True) or body["finish_reason"] or body["logprobs"]:  # not all held back
                    yield chunk([body])
            offsets[index] = offsets.get(index, 0) + len(delta.text)
        if failure := job.failure():
            raise failure
        if job.include_usage:
            yield chunk([], usage=job.usage())
    except Exception as e:  # the stream has begun (200): the error goes in it
        failure = e if isinstance(e, ApiError) else _unexpected(e, job.id)
        server.count(failure)
        yield event(failure.body())
    finally:  # also when the client went away: its slots are freed at the engine's next step
        job.cancel()
        server.finished(job.generations)
    yield b"data: [DONE]\n\n"


def _unexpected(e: Exception, request_id: str) -> ApiError:
    if isinstance(e, RequestFailed | TimeoutError):
        return ApiError.of(e).about(request_id)
    log.error("request %s failed while its stream was written", request_id, exc_info=e)
    message = f"request {request_id} failed ({type(e).__name__}); the server's log has why"
    return ApiError(500, message, "internal_error", "internal_error").about(request_id)

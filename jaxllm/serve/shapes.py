"""The bodies this server sends, in OpenAI's shapes: built as plain dicts on the hot path, and
declared once more as pydantic models for the OpenAPI document (a fuzzer checks each response
against them, so the two cannot drift apart unnoticed)."""

from __future__ import annotations

import itertools
import time
from typing import Literal

from pydantic import BaseModel

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.serve.generation import Logprob, Tokens
from jaxllm.serve.protocol import ToolCall

FinishReason = Literal["stop", "length", "tool_calls"] | None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(request_id: str, kind: str, model: str, choices: list[dict], **extra) -> dict:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}


def error(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[Logprob], top: int, offset: int = 0) -> dict:
    """The completions API's log-probs of `logprobs`, whose text starts at `offset`."""
    tokens = [tokenizer.decode([lp.token]) for lp in logprobs]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            None if lp.top is None else {tokenizer.decode([t]): v for t, v in lp.top[:top]} for lp in logprobs
        ],
        "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))[: len(tokens)],
    }


def prompt_logprobs(prompt: list[int], scored: Tokens, top: int) -> list[Logprob]:
    """A prompt's log-probs (`Generation.prompt_logprobs`) as `Logprob`s; the first token has none."""
    rows = zip(*(a.tolist() for a in scored), strict=True)
    return [Logprob(prompt[0], None, None)] + [
        Logprob(i, v, list(zip(t[:top], tv[:top], strict=True))) for i, v, t, tv in rows
    ]


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[Logprob], top: int) -> dict:
    def entry(token: int, logprob: float) -> dict:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(*t) for t in lp.top[:top]]}
                        for lp in logprobs]}  # fmt: skip


# The same bodies as models, for the OpenAPI document.


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None: the answer is its tool calls
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str

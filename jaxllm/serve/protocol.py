"""OpenAI's request bodies as this server takes them, and the bodies it sends back.

Unknown fields are ignored, as OpenAI's clients expect; fields this server cannot honour are
refused by name (`unsupported`) rather than silently dropped. `top_k` and `ignore_eos` are
extensions (vLLM's names)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.serve.engine import Logprob, Request, RequestError
from jaxllm.serve.steps import Tokens


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate at character {e.start}; send valid Unicode text") from e
    return text


Text = Annotated[str, AfterValidator(_unicode)]


# Each field, and whether a value of it changes nothing (then it passes).
UNSUPPORTED = {
    "logit_bias": lambda v: v in (None, {}),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "repetition_penalty": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: v in (None, []),
    "functions": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
}


def unsupported(body: dict) -> None:
    """Refuses the first field this server cannot honour, by name."""
    for field, harmless in UNSUPPORTED.items():
        try:
            ok = harmless(body.get(field))
        except TypeError:  # an unhashable value where a scalar was expected
            ok = False
        if not ok:
            raise RequestError(f"{field} is not supported by this server; leave it out", "unsupported_field", field)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Text
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def request(self, prompt: list[int], max_tokens: int, logprobs: int | None) -> Request:
        return Request(
            prompt, max_tokens, self.temperature, self.top_k, self.top_p, self.seed, self.n, self.stops,
            self.ignore_eos, logprobs,
        )  # fmt: skip


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # None: as many as the slot holds
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else p


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None  # None: as many as the slot holds
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(request_id: str, kind: str, model: str, choices: list[dict], **extra) -> dict:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[Logprob], top: int, offset: int = 0) -> dict:
    """The completions API's log-probs of `logprobs`, whose text starts at `offset`."""
    tokens = [tokenizer.decode([lp.token]) for lp in logprobs]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            None if lp.top is None else {tokenizer.decode([t]): v for t, v in lp.top[:top]} for lp in logprobs
        ],
        "text_offset": offsets,
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

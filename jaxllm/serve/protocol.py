"""OpenAI's request bodies as this server takes them, each bound set by the engine's limits.

Unknown fields are ignored, as OpenAI's clients expect; fields this server cannot honour are
refused by name (`unsupported`) rather than silently dropped. `top_k` and `ignore_eos` are
extensions (vLLM's names)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, create_model

from jaxllm.serve.generation import SEEDS, Limits, Request, RequestError
from jaxllm.serve.steps import TOP_LOGPROBS
from jaxllm.serve.stream import EMPTY_STOP, MAX_STOPS


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate at character {e.start}; send valid Unicode text") from e
    return text


Text = Annotated[str, AfterValidator(_unicode)]


def _listed(value):
    return [value] if isinstance(value, str) else value


def _not_empty(stop: str) -> str:
    if not stop:
        raise ValueError(EMPTY_STOP)
    return stop


# A stop string: never empty (one would match before any text; vLLM refuses it too).
Stop = Annotated[Text, AfterValidator(_not_empty), Field(json_schema_extra={"minLength": 1})]


def stop_strings(most: int):
    """`stop`: a string or up to `most` strings, validated as a list (so a refusal names one form)."""
    strings = Annotated[list[Stop], Field(max_length=most)]
    return Annotated[strings | None, BeforeValidator(_listed, json_schema_input_type=Stop | strings | None)]


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
    """The fields completions and chats share. The bounds that depend on the server (`n`, `top_k`,
    `max_tokens`, the prompt's) are set by `request_models`."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Text = Field(description="the served model's id (GET /v1/models)")
    temperature: float = Field(1.0, ge=0, le=2, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0: no limit")
    n: int = Field(1, ge=1, description="choices, each decoded in a slot of its own")
    seed: int | None = Field(None, ge=0, lt=SEEDS, description="None: a random one")
    stop: stop_strings(MAX_STOPS) = Field(None, description="strings that end a choice")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

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
    max_tokens: int | None = Field(16, ge=1, description="None: as many as the slot holds")
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
    max_tokens: int | None = Field(None, ge=1, description="None: as many as the slot holds")
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' newer name; wins over it")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)


def _prompt_form(value) -> str | None:
    """Which of its four forms a completion's prompt takes, by its shape, so a refusal speaks of
    that form alone (a union would report every form's complaint)."""
    if isinstance(value, str):
        return "text-prompt"
    if isinstance(value, list):
        first = value[0] if value else ""
        return (
            "text-prompts" if isinstance(first, str) else "token-id-lists" if isinstance(first, list) else "token-ids"
        )
    return None


# The setting behind each upper bound `request_models` sets, named when a value passes it.
BOUNDS = {
    "prompt": "serve.slots prompts, serve.max_prompt_tokens tokens each, ids below the vocabulary's size",
    "messages": "serve.max_prompt_tokens",
    "n": "serve.slots",
    "top_k": "the vocabulary's size",
    "max_tokens": "serve.max_len less one",
    "max_completion_tokens": "serve.max_len less one",
    "seed": "2**32",
}


def request_models(limits: Limits, model_name: str) -> tuple[type[CompletionRequest], type[ChatRequest]]:
    """The request bodies one server takes: every bound from its engine's `limits`, so a value
    the engine could not serve is refused where it is parsed (422, naming the bound), and the
    OpenAPI document states each bound."""
    token = Annotated[int, Field(ge=0, lt=limits.vocab_size)]
    ids = Annotated[list[token], Field(min_length=1, max_length=limits.max_prompt)]
    # Tags that are no identifiers stay out of a refusal's `param` (see `Server.parse`).
    prompt = Annotated[
        Annotated[Text, Tag("text-prompt")]
        | Annotated[list[Text], Tag("text-prompts"), Field(min_length=1, max_length=limits.slots)]
        | Annotated[ids, Tag("token-ids")]
        | Annotated[list[ids], Tag("token-id-lists"), Field(min_length=1, max_length=limits.slots)],
        Discriminator(_prompt_form, custom_error_type="prompt_form",
                      custom_error_message="send text, token ids, or a list of either"),
        Field(description=f"text or token ids (below {limits.vocab_size}), or a list of up to {limits.slots} "
                          f"(serve.slots) of either; at most {limits.max_prompt} tokens each"),
    ]  # fmt: skip
    most = limits.max_len - 1  # a one-token prompt leaves room for this many
    bounded = dict(
        model=(Text, Field(description="the served model's id", json_schema_extra={"enum": [model_name]})),
        n=(int, Field(1, ge=1, le=limits.slots, description="choices, each in a slot of its own (serve.slots)")),
        top_k=(int, Field(0, ge=0, le=limits.vocab_size, description="0: no limit; at most the vocabulary")),
        stop=(stop_strings(limits.stops), Field(None, description=f"up to {limits.stops} strings that end a choice")),
    )  # fmt: skip

    def max_tokens(default: int | None):
        return int | None, Field(default, ge=1, le=most, description="None: as many as the slot holds (serve.max_len)")

    completion = create_model(
        "CompletionRequest", __base__=CompletionRequest, prompt=(prompt, ...), max_tokens=max_tokens(16), **bounded
    )
    messages = Annotated[list[Message], Field(min_length=1, max_length=limits.max_prompt)]
    chat = create_model(
        "ChatRequest", __base__=ChatRequest, messages=(messages, ...), max_tokens=max_tokens(None),
        max_completion_tokens=max_tokens(None), **bounded,
    )  # fmt: skip
    return completion, chat

"""OpenAI's request bodies as this server takes them, each bound set by the engine's limits.

Unknown fields are ignored, as OpenAI's clients expect; fields this server cannot honour are
refused by name (`unsupported`) rather than silently dropped. `top_k`, `min_p` and `ignore_eos`
are extensions (vLLM's names)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, create_model

from jaxllm.serve.generation import SEEDS, TOP_LOGPROBS, Limits, Request, RequestError
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


# vLLM's older constraints, each with its field of `structured_outputs`.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# Fields this server cannot honour (OpenAI's, and vLLM's sampling extensions), each with the values
# that ask for nothing: a request giving another is refused, not answered as if it had not asked.
UNSUPPORTED = {
    "logit_bias": lambda v: v in (None, {}),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "repetition_penalty": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "functions": lambda v: v in (None, []),  # tools' old form
    "function_call": lambda v: v in (None, "none"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "min_tokens": lambda v: v in (None, 0),
    "stop_token_ids": lambda v: v in (None, []),
    "bad_words": lambda v: v in (None, []),
    "allowed_token_ids": lambda v: v is None,
    "use_beam_search": lambda v: v in (None, False),
    "include_stop_str_in_output": lambda v: v in (None, False),
    "prompt_logprobs": lambda v: v is None,
    "truncate_prompt_tokens": lambda v: v is None,
    **dict.fromkeys(GUIDED, lambda v: v is None),
}


def unsupported(body: dict) -> None:
    """Refuses the first field this server cannot honour, by name."""
    for field, harmless in UNSUPPORTED.items():
        try:
            ok = harmless(body.get(field))
        except TypeError:  # an unhashable value where a scalar was expected
            ok = False
        if not ok:
            fix = f"give structured_outputs.{GUIDED[field]} instead" if field in GUIDED else "leave it out"
            raise RequestError(f"{field} is not supported by this server; {fix}", "unsupported_field", field)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchema(BaseModel):
    name: str = "output"
    description: str | None = None
    schema_: dict = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the schema holds either way: every output is sampled under it


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one of a JSON schema, a regular expression,
    a list of strings to choose from, or a Lark grammar."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[Text] | None = None
    grammar: str | None = None


class Function(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class ToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(BaseModel):
    """The fields completions and chats share. The bounds that depend on the server (`n`, `top_k`,
    `max_tokens`, the prompt's) are set by `request_models`."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Text = Field(description="the served model's id (GET /v1/models)")
    temperature: float = Field(1.0, ge=0, le=2, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0: no limit")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM's: only tokens at least min_p times as likely "
                                "as the likeliest (None or 0: no limit)")  # fmt: skip
    n: int = Field(1, ge=1, description="choices, each decoded in a slot of its own")
    seed: int | None = Field(None, ge=0, lt=SEEDS, description="None: a random one")
    stop: stop_strings(MAX_STOPS) = Field(None, description="strings that end a choice")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    structured_outputs: StructuredOutputs | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def request(self, prompt: list[int], max_tokens: int, logprobs: int | None, constraint=None) -> Request:
        return Request(
            prompt, max_tokens, self.temperature, self.top_k, self.top_p, self.seed, self.n, self.stops,
            self.ignore_eos, logprobs, constraint, self.min_p or 0.0,
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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None  # None: an assistant turn of tool calls only
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def turn(self) -> dict:
        """The message as a chat template sees it (tool calls' arguments as objects, as
        transformers' templates expect)."""
        turn = {"role": self.role, "content": self.text}
        if self.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="None: as many as the slot holds")
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' newer name; wins over it")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool = True


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


# vLLM's /tokenize and /detokenize. Their refusals are 400s, as vLLM's are.


def _left_out(value):
    """Refuses a vLLM field this route cannot honour unless it is off."""
    if value:
        raise ValueError("not supported by this route; leave it out")
    return value


Off = Annotated[bool | None, AfterValidator(_left_out)]


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text = Field(description="the served model's id (GET /v1/models)")
    prompt: Text = Field(description="text, tokenized as a completion's prompt is, of any length")
    add_special_tokens: bool = Field(True, description="start with what the model's tokenizer puts first (bos)")
    return_token_strs: Off = None


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text = Field(description="the served model's id (GET /v1/models)")
    messages: list[Message] = Field(min_length=1, description="rendered and tokenized as a chat completion's")
    add_generation_prompt: bool = True
    add_special_tokens: bool = Field(False, description="put what the model's tokenizer puts first (bos) before it")
    return_token_strs: Off = None
    continue_final_message: Off = None
    chat_template: Annotated[str | None, AfterValidator(_left_out)] = None
    chat_template_kwargs: Annotated[dict | None, AfterValidator(_left_out)] = None
    tools: list[Tool] | None = Field(None, description="rendered by the template, as a chat completion's")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text = Field(description="the served model's id (GET /v1/models)")
    tokens: list[int] = Field(min_length=1)


def tokenize_models(limits: Limits, model_name: str) -> tuple[type, type, type]:
    """/tokenize's two bodies (text, chat) and /detokenize's, for one server: token ids are
    integers (not 5.0 or "5") in its vocabulary."""

    def in_vocabulary(token: int) -> int:
        if not 0 <= token < limits.vocab_size:
            raise ValueError(f"not a token id of this model: send integers in [0, {limits.vocab_size})")
        return token

    model = (Text, Field(description="the served model's id", json_schema_extra={"enum": [model_name]}))
    schema = {"minimum": 0, "exclusiveMaximum": limits.vocab_size}
    token = Annotated[int, Field(strict=True, json_schema_extra=schema), AfterValidator(in_vocabulary)]
    tokens = (list[token], Field(min_length=1, description=f"token ids, each in [0, {limits.vocab_size})"))
    return (
        create_model("TokenizeCompletionRequest", __base__=TokenizeCompletionRequest, model=model),
        create_model("TokenizeChatRequest", __base__=TokenizeChatRequest, model=model),
        create_model("DetokenizeRequest", __base__=DetokenizeRequest, model=model, tokens=tokens),
    )

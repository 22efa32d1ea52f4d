"""Chat messages → text, by a Jinja template in a sandbox: the one renderer that training (the
`chat` data format) and serving share, so a model is served the prompts it was trained on.

A template follows the Hugging Face convention: it sees `messages` (each with `role` and
`content`), `tools`, `add_generation_prompt`, `bos_token`, `eos_token` and
`raise_exception(message)`. A model's own template (its tokenizer's) renders as transformers renders
it (blocks trimmed, loop controls, `strftime_now`, `{% generation %}` tags); a template file keeps its
whitespace. Without either, `DEFAULT` is a plain transcript, one `role: content` line per message,
each assistant turn ended by the end-of-text token (so a served model stops there), and `assistant:`
for the model to continue.
"""

from __future__ import annotations

import datetime
import json
import pathlib

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxllm.config import ConfigError
from jaxllm.errors import JaxllmError

DEFAULT = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% if m.role == 'assistant' %}{{ eos_token }}{% else %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(JaxllmError):
    """A template that refuses or cannot render a conversation; the message says which and why."""


def _raise(message: str):
    raise ChatTemplateError(message)


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (marking assistant text), rendered
    as its body: the loss mask here comes from rendering conversations incrementally instead."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _transformers_environment() -> ImmutableSandboxedEnvironment:
    """Jinja as transformers renders a model's own template: blocks trimmed, loop controls,
    `strftime_now` and a `tojson` that keeps non-ASCII text (Llama 3.1's template uses them)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return env


def special_tokens(tokenizer) -> dict[str, str]:
    """The special tokens' text that templates see as `bos_token` and `eos_token`."""
    return {"bos_token": tokenizer.decode([tokenizer.bos_id]), "eos_token": tokenizer.decode([tokenizer.eos_id])}


class ChatTemplate:
    def __init__(
        self,
        source: str = DEFAULT,
        tokens: dict[str, str] | None = None,
        origin: str = "the built-in chat template",
        transformers_style: bool = False,
    ):
        """`tokens`: the special tokens' text, `bos_token` and `eos_token`. `transformers_style`:
        render as transformers does (a model's own template), not keeping the source's whitespace."""
        env = (
            _transformers_environment()
            if transformers_style
            else ImmutableSandboxedEnvironment(keep_trailing_newline=True, extensions=[_Generation])
        )
        self.origin = origin
        self.source = f"{'transformers' if transformers_style else 'file'} style\n{source}"  # what renders
        try:
            self.template = env.from_string(source)
            self.tokens = tokens or {}
            self.render([{"role": "user", "content": "Hello"}])
        except (jinja2.TemplateError, ChatTemplateError) as e:
            raise ConfigError(f"{origin} does not render a one-message chat: {e}; fix the template") from e

    @classmethod
    def chosen(cls, path: str | None, own: str | None, tokens: dict[str, str], flag: str = "--chat-template"):
        """The template in the file at `path`, else the model's `own` (its tokenizer's), else the built-in one."""
        if path is None:
            return cls(tokens=tokens) if own is None else cls(own, tokens, "the tokenizer's chat template", True)
        file = pathlib.Path(path)
        if not file.is_file():
            raise ConfigError(f"{flag} {path}: no such file; give a Jinja template")
        return cls(file.read_text(), tokens, f"{flag} {path}")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """The text for `messages`; `ChatTemplateError` if the template refuses them."""
        try:
            return self.template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                raise_exception=_raise,
                **self.tokens,
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # a template's own error, whatever its kind, is about these messages
            raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from e

    def assistant_spans(self, messages: list[dict], tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and the [start, end) characters of each assistant turn (its
        content and end-of-turn): what rendering through that turn adds to the prompt before it."""
        text = self.render(messages, False, tools)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = self.render(messages[:i], True, tools), self.render(messages[: i + 1], False, tools)
            if not (through.startswith(before) and text.startswith(through)):
                raise ChatTemplateError(
                    f"{self.origin} does not render conversations incrementally (the text up to assistant "
                    f"message {i} is not a prefix of the whole), so its assistant tokens cannot be found; give "
                    "data.chat_template a template that only appends"
                )
            spans.append((len(before), len(through)))
        return text, spans

"""Chat messages → one prompt, by a Jinja template in a sandbox: the built-in one, or a file
(`--chat-template`) written to the Hugging Face convention, which sees `messages` (each with
`role` and `content`), `add_generation_prompt`, `bos_token`, `eos_token` and
`raise_exception(message)`.

A model converted from Hugging Face brings its own template (its tokenizer_config.json's), rendered
as transformers renders it (blocks trimmed, loop controls, `strftime_now`). The built-in template
is a plain transcript, one `role: content` line per message, ending with `assistant:` for the
model to continue; it suits a model trained on plain text."""

from __future__ import annotations

import datetime
import json
import pathlib

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxllm.config import ConfigError
from jaxllm.serve.generation import RequestError

BUILTIN = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise(message: str):
    raise RequestError(message, "invalid_messages", "messages")


def _transformers_environment() -> ImmutableSandboxedEnvironment:
    """Jinja as transformers renders a model's own template: blocks trimmed, loop controls,
    `strftime_now` and a `tojson` that keeps non-ASCII text (Llama 3.1's template uses them)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return env


class ChatTemplate:
    def __init__(
        self,
        source: str = BUILTIN,
        tokens: dict[str, str] | None = None,
        origin: str = "the built-in chat template",
        transformers_style: bool = False,
    ):
        """`tokens`: the special tokens' text, `bos_token` and `eos_token`. `transformers_style`:
        render as transformers does (a model's own template), not keeping the source's whitespace."""
        env = (
            _transformers_environment()
            if transformers_style
            else ImmutableSandboxedEnvironment(keep_trailing_newline=True)
        )
        try:
            self.template = env.from_string(source)
            self.tokens = tokens or {}
            self.render([{"role": "user", "content": "Hello"}])
        except (jinja2.TemplateError, RequestError) as e:
            raise ConfigError(f"{origin} does not render a one-message chat: {e}; fix the template") from e

    @classmethod
    def chosen(cls, path: str | None, own: str | None, tokens: dict[str, str]) -> ChatTemplate:
        """The template in the file at `path`, else the model's `own` (its tokenizer's), else the built-in one."""
        if path is None:
            return cls(tokens=tokens) if own is None else cls(own, tokens, "the tokenizer's chat template", True)
        file = pathlib.Path(path)
        if not file.is_file():
            raise ConfigError(f"--chat-template {path}: no such file; give a Jinja template")
        return cls(file.read_text(), tokens, f"--chat-template {path}")

    def render(self, messages: list[dict]) -> str:
        """The prompt for `messages`; `RequestError` if the template refuses them."""
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=True, raise_exception=_raise, **self.tokens
            )
        except RequestError:
            raise
        except Exception as e:  # a template's own error, whatever its kind, is about these messages
            raise RequestError(f"the chat template cannot render these messages: {e}", "invalid_messages") from e

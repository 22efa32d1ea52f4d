"""Serving's side of the chat renderer that training shares (`jaxllm.data.chat`): the built-in
template, a `--chat-template` file, or the model's own; a template's refusal ends the request with
a 422 (`invalid_messages`)."""

from __future__ import annotations

from jaxllm.data.chat import DEFAULT as BUILTIN
from jaxllm.data.chat import ChatTemplate as _Shared
from jaxllm.data.chat import ChatTemplateError
from jaxllm.serve.generation import RequestError

__all__ = ["BUILTIN", "ChatTemplate"]


class ChatTemplate(_Shared):
    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        """The prompt for `messages`; `RequestError` if the template refuses them."""
        try:
            return super().render(messages, add_generation_prompt, tools)
        except ChatTemplateError as e:
            raise RequestError(str(e), "invalid_messages", "messages") from e

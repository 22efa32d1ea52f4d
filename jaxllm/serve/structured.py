"""What a request's structured-output fields ask for, as a `Constraint`, and a tool-calling
chat's output read back as OpenAI's `tool_calls`.

Tool calls are written as a JSON array of `{"name": ..., "arguments": {...}}` objects, each
held to its function's parameter schema. With `tool_choice` `auto` the output is either such an
array or text that does not start with `[`; `required` and a named function allow only calls
(of that function); `none` leaves the output free. One request holds one constraint: tools
(other than `none`) with a response format or `structured_outputs` are refused.
"""

from __future__ import annotations

import json
import uuid

from jaxllm.serve import protocol
from jaxllm.serve.constraints import Constraint, Grammars, compact
from jaxllm.serve.generation import RequestError


def constraint(grammars: Grammars, body: protocol._Sampling) -> Constraint | None:
    """The constraint `body`'s fields ask for (None: free text)."""
    asked = [name for name in ("structured_outputs", "response_format") if getattr(body, name, None) is not None]
    if isinstance(body, protocol.ChatRequest) and (calls := Calls(body)).active:
        if asked:
            raise RequestError(f"{asked[0]} cannot be combined with tools; send one or the other", "invalid_grammar",
                               asked[0])  # fmt: skip
        return grammars.lark(calls.lark(), "tools")
    if body.structured_outputs is not None:
        return _structured(grammars, body.structured_outputs)
    return _response_format(grammars, getattr(body, "response_format", None))


def _structured(grammars: Grammars, wanted: protocol.StructuredOutputs) -> Constraint:
    fields = {"json": wanted.json_, "regex": wanted.regex, "choice": wanted.choice, "grammar": wanted.grammar}
    given = [name for name, value in fields.items() if value is not None]
    if len(given) != 1:
        raise RequestError(f"structured_outputs names {len(given)} of json, regex, choice and grammar; give exactly "
                           "one", "invalid_grammar", "structured_outputs")  # fmt: skip
    param = f"structured_outputs.{given[0]}"
    if wanted.json_ is not None:
        schema = wanted.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise RequestError(f"{param} is not JSON ({e})", "invalid_schema", param) from None
        return grammars.json_schema(schema, param)
    if wanted.regex is not None:
        return grammars.regex(wanted.regex, param)
    if wanted.choice is not None:
        return grammars.choice(wanted.choice, param)
    return grammars.lark(wanted.grammar, param)


def _response_format(grammars: Grammars, wanted: protocol.ResponseFormat | None) -> Constraint | None:
    if wanted is None or wanted.type == "text":
        return None
    if wanted.type == "json_object":
        return grammars.json_object("response_format")
    if wanted.json_schema is None:
        raise RequestError("response_format of type json_schema needs its json_schema: {name, schema}",
                           "invalid_schema", "response_format.json_schema")  # fmt: skip
    return grammars.json_schema(wanted.json_schema.schema_, "response_format.json_schema.schema")


class Calls:
    """A chat's `tools` and `tool_choice`: the grammar of its calls, and its output read as calls."""

    def __init__(self, body: protocol.ChatRequest):
        self.tools = {t.function.name: t.function for t in body.tools or []}
        choice = body.tool_choice or "auto"
        if (choice == "required" or isinstance(choice, protocol.ToolChoice)) and not self.tools:
            raise RequestError("tool_choice asks for a tool call, but the request has no tools; send tools",
                               "invalid_value", "tool_choice")  # fmt: skip
        if isinstance(choice, protocol.ToolChoice):
            if choice.function.name not in self.tools:
                raise RequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                   "invalid_value", "tool_choice")  # fmt: skip
            self.callable, self.only_calls = [choice.function.name], True
        else:
            self.callable, self.only_calls = list(self.tools), choice == "required"
        self.active = bool(self.tools) and choice != "none"
        self.parallel = body.parallel_tool_calls

    def schema(self) -> dict:
        """The JSON schema of the calls: an array of one or more (one, without parallel calls)."""
        calls = [
            {"type": "object", "properties": {"name": {"const": name}, "arguments": self.tools[name].parameters},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name in self.callable
        ]  # fmt: skip
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        return compact(schema | ({} if self.parallel else {"maxItems": 1}))

    def lark(self) -> str:
        calls = f"calls: %json {json.dumps(self.schema())}"
        if self.only_calls:
            return f"start: calls\n{calls}\n"
        return f"start: calls | text\n{calls}\ntext: /[^\\[](.|\\n)*/\n"

    def read(self, text: str) -> list[dict] | None:
        """The output as OpenAI's `tool_calls`, if it is a whole array of calls."""
        if not self.active or not text.startswith("["):
            return None
        try:
            calls = json.loads(text)
        except ValueError:
            return None  # cut short (max_tokens, a stop string): its text is what there is
        return [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls
        ]  # fmt: skip

"""Structured outputs: a request's output held to a grammar (a JSON schema, a regular expression,
a Lark grammar, one of fixed strings) by a token mask per step, with llguidance.

llguidance computes the mask lazily from the grammar and the tokenizer's token trie: a schema
costs nothing to compile ahead (outlines-core builds a whole automaton per schema first) and it
needs no torch (xgrammar does). A grammar is checked against the tokenizer when the request
arrives, so an unsatisfiable or unsupported schema is the request's error, naming the part.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.serve.generation import RequestError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compact(schema: dict) -> dict:
    """`schema` written as OpenAI's models write JSON, one space after `,` and `:` and no other
    whitespace (llguidance's `x-guidance` options; the schema's own, if any, win). A grammar that
    allowed free whitespace would let a model spin in it."""
    return schema | {"x-guidance": JSON_OPTIONS | schema.get("x-guidance", {})}


def mask_words(vocab_size: int) -> int:
    """Int32 words of a token bitmask over `vocab_size` ids."""
    return -(-vocab_size // 32)


class Matcher:
    """One output's place in its grammar."""

    def __init__(self, matcher: LLMatcher, words: int):
        self._matcher, self._words = matcher, words

    def fill(self, row: np.ndarray) -> None:
        """The ids the grammar allows next, as bits of `row` (int32, C-contiguous)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, self._words * 4)
        row[self._words :] = 0

    def take(self, token: int) -> bool:
        """Moves past `token`; True once the output is complete (nothing but its end can follow)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} breaks the grammar: {self._matcher.get_error()}")
        return self._matcher.is_stopped()


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A checked grammar (llguidance's form) over one tokenizer."""

    grammar: str
    tokenizer: LLTokenizer = dataclasses.field(repr=False, compare=False)

    def matcher(self) -> Matcher:
        return Matcher(LLMatcher(self.tokenizer, self.grammar, log_level=0), mask_words(self.tokenizer.vocab_size))


class Grammars:
    """Builds checked `Constraint`s for `tokenizer`'s outputs; a grammar that cannot be used
    raises `RequestError` naming the request's field (`param`) and the part at fault."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer.grammar_tokenizer()

    def json_schema(self, schema: dict, param: str) -> Constraint:
        if not isinstance(schema, dict):
            raise RequestError(f"{param} is a JSON {type(schema).__name__}; a schema is an object", "invalid_schema",
                               param)  # fmt: skip
        try:
            text = json.dumps(compact(schema), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise RequestError(f"{param} is not a JSON schema ({e})", "invalid_schema", param) from None
        return self._checked(LLMatcher.grammar_from_json_schema(text), param, "schema")

    def json_object(self, param: str) -> Constraint:
        return self.json_schema({"type": "object"}, param)

    def regex(self, pattern: str, param: str) -> Constraint:
        return self._checked(LLMatcher.grammar_from_regex(pattern), param, "regex")

    def lark(self, source: str, param: str) -> Constraint:
        return self._checked(LLMatcher.grammar_from_lark(source), param, "grammar")

    def choice(self, options: list[str], param: str) -> Constraint:
        if not options:
            raise RequestError(f"{param} is empty; give at least one string to choose from", "invalid_grammar", param)
        alternatives = " | ".join(json.dumps(o) for o in options)  # a Lark string literal is a JSON string
        return self.lark(f"start: {alternatives}", param)

    def _checked(self, grammar: str, param: str, what: str) -> Constraint:
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if failed:
            detail = "; ".join(m.strip() for m in messages)
            raise RequestError(f"{param}: this {what} cannot constrain an output: {detail}", f"invalid_{what}", param)
        return Constraint(grammar, self._tokenizer)

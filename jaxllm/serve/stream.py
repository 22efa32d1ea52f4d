"""A request's tokens → the text it may show so far, and when it is finished.

Text is released only once it is final: never a part of a multi-byte character still being
spelt out over several tokens, and never the start of what could still become a stop string.
A stop string ends the request and is left out of its text (of several, the one that starts
first in the text; an empty one is refused); so is an end-of-sequence token (the tokenizer's
`stop_ids`, unless `ignore_eos`); `max_tokens` ends it with `length`.

Each token costs a decode of the few tokens since the last complete character, not of the whole
output: `text` grows by what `tokens[_start:]` decodes to beyond `tokens[_start:_end]` (decoding
from a token before the new ones keeps tokenizers that drop a leading space correct).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxllm.data.tokenizer import Tokenizer

MAX_STOPS = 4
INCOMPLETE = "\ufffd"  # what decoding shows for the bytes of an unfinished character
EMPTY_STOP = "a stop string is empty: it would end the request before any text; leave it out"


class TextStream:
    def __init__(self, tokenizer: Tokenizer, max_tokens: int, stop: Sequence[str] = (), ignore_eos: bool = False):
        stop = list(stop)
        if len(stop) > MAX_STOPS:
            raise ValueError(f"{len(stop)} stop strings given; at most {MAX_STOPS} are allowed")
        if not all(stop):
            raise ValueError(EMPTY_STOP)
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be at least 1")
        self.tokenizer, self.max_tokens, self.stop, self.ignore_eos = tokenizer, max_tokens, stop, ignore_eos
        self.tokens: list[int] = []
        self.text = ""  # the decoded tokens, up to their last complete character
        self.released = ""  # the text shown so far
        self.finish_reason: str | None = None  # 'stop' or 'length' once finished
        self._start = self._end = 0  # tokens[_start:_end] decode to the end of `text`

    def push(self, token: int) -> str:
        """Takes the request's next token; returns the text that became final with it."""
        if self.finish_reason is not None:
            raise ValueError("the request is finished; push no more tokens")
        if token in self.tokenizer.stop_ids and not self.ignore_eos:
            return self._finish("stop", self.text + self._pending())
        self.tokens.append(token)
        pending = self._pending()
        if pending and not pending.endswith(INCOMPLETE):
            self.text, pending = self.text + pending, ""
            self._start, self._end = self._end, len(self.tokens)
        text = self.text + pending
        # Released text never ends in the start of a stop string, so a stop starts after it.
        hits = [at for at in (text.find(s, len(self.released)) for s in self.stop) if at >= 0]
        if hits:
            return self._finish("stop", text[: min(hits)])
        if len(self.tokens) >= self.max_tokens:
            return self._finish("length", text)
        return self._release(self.text[: len(self.text) - self._held()])

    def end(self) -> str:
        """Finishes now (`stop`: a grammar's output is complete); returns the rest of the text."""
        return self._finish("stop", self.text + self._pending())

    def _pending(self) -> str:
        """The text of the tokens after `_end`, complete or not."""
        before = self.tokenizer.decode(self.tokens[self._start : self._end])
        return self.tokenizer.decode(self.tokens[self._start :])[len(before) :]

    def _held(self) -> int:
        """How many trailing characters of `text` are not final yet: the longest ending that
        begins a stop string (the next token may continue it)."""
        text = self.text
        return max(
            (n for s in self.stop for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])), default=0
        )

    def _release(self, final: str) -> str:
        if len(final) <= len(self.released):
            return ""
        new, self.released = final[len(self.released) :], final
        return new

    def _finish(self, reason: str, final: str) -> str:
        self.finish_reason = reason
        return self._release(final)

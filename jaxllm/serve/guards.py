"""What the HTTP server checks before and after a request reaches the engine: API keys, a token
bucket per key, a deny-list of regexes, and the prompt perplexity alarm (which the engine asks
once a prompt is scored, so a refused prompt generates nothing)."""

from __future__ import annotations

import math
import os
import pathlib
import re
import time
import unicodedata

import numpy as np

from jaxllm.config import ConfigError
from jaxllm.serve.generation import Generation, RequestError

PPL_WINDOW = 32  # tokens: a short burst of gibberish inside a long, ordinary prompt still shows


def load_api_keys(path: str | None) -> frozenset[str]:
    """The keys in `path` (one per line; blank lines and # comments skipped) and in
    `JAXLLM_API_KEYS` (comma-separated). None at all: authentication is off."""
    keys = [k.strip() for k in os.environ.get("JAXLLM_API_KEYS", "").split(",")]
    if path is not None:
        file = pathlib.Path(path)
        if not file.is_file():
            raise ConfigError(f"--api-keys {path}: no such file; give a file with one key per line")
        keys += [line.split("#", 1)[0].strip() for line in file.read_text().splitlines()]
    return frozenset(k for k in keys if k)


class RateLimiter:
    """A token bucket per key: `burst` requests at once, refilled at `rate` per second."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key → (tokens, when)

    def take(self, key: str) -> int:
        """Spends one of `key`'s tokens; returns 0, or the whole seconds to wait if it has none."""
        now = self.clock()
        tokens, then = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens < 1:
            self._buckets[key] = (tokens, now)
            return math.ceil((1 - tokens) / self.rate)
        self._buckets[key] = (tokens - 1, now)
        if len(self._buckets) > 65536:  # forget keys whose buckets have refilled: they read as new
            full = self.burst / self.rate
            self._buckets = {k: (t, w) for k, (t, w) in self._buckets.items() if now - w < full}
        return 0


class DenyList:
    """Regexes refused in any request's text, matched against its NFKC-normalised, casefolded
    form, so full-width letters, ligatures and case do not slip past a pattern."""

    def __init__(self, patterns: list[str]):
        self.patterns = [re.compile(p) for p in patterns]

    @classmethod
    def from_file(cls, path: str | None) -> DenyList:
        """One regex per line (blank lines and lines starting with # skipped)."""
        if path is None:
            return cls([])
        file = pathlib.Path(path)
        if not file.is_file():
            raise ConfigError(f"--deny {path}: no such file; give a file with one regex per line")
        patterns = []
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                try:
                    re.compile(line)
                except re.error as e:
                    raise ConfigError(f"--deny {path}, line {number}: {line!r} is not a regex ({e}); fix it") from e
                patterns.append(line)
        return cls(patterns)

    def match(self, text: str) -> str | None:
        """The first pattern found in `text`, if any."""
        folded = unicodedata.normalize("NFKC", text).casefold()
        return next((p.pattern for p in self.patterns if p.search(folded)), None)


def prompt_perplexity(nll: np.ndarray) -> tuple[float, float]:
    """The perplexity of a prompt's tokens, given each one's NLL: over them all, and in the worst
    `PPL_WINDOW`-token window (the whole prompt if shorter). A one-token prompt has 1."""
    if not len(nll):
        return 1.0, 1.0
    whole = float(np.exp(np.mean(nll)))
    if len(nll) <= PPL_WINDOW:
        return whole, whole
    sums = np.cumsum(np.concatenate([[0.0], nll]))
    return whole, float(np.exp(np.max(sums[PPL_WINDOW:] - sums[:-PPL_WINDOW]) / PPL_WINDOW))


class PerplexityAlarm:
    """Sounds when a prompt's perplexity (whole, or its worst window) passes `limit`
    (`serve.ppl_alarm`); with `reject` (`serve.ppl_reject`), the request is refused."""

    def __init__(self, limit: float | None, reject: bool):
        self.limit, self.reject = limit, reject

    def judge(self, generation: Generation, nll: np.ndarray) -> RequestError | None:
        """Records the prompt's perplexity from its tokens' NLL, and whether the alarm sounds;
        returns the refusal if it refuses the request."""
        generation.perplexity = whole, window = prompt_perplexity(nll)
        generation.alarm = self.limit is not None and max(whole, window) > self.limit
        if not (generation.alarm and self.reject):
            return None
        message = (
            f"the prompt's perplexity ({whole:.1f} whole, {window:.1f} in its worst {PPL_WINDOW}-token window) is "
            f"above this server's limit of {self.limit:g} (serve.ppl_alarm); send text the model can read"
        )
        return RequestError(message, "perplexity_alarm", "prompt")

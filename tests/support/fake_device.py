"""The serving engine's device side in numpy, for tests of the host side and the HTTP layer that
need no model: each row draws uniformly among the tokens its mask allows, from a generator seeded
as the real sampler's key is (the request's seed, its choice and the token's index; greedy rows by
their position and last token). A model that cares nothing for a grammar is the hardest test of
structured outputs: whatever it draws must still parse."""

from __future__ import annotations

import numpy as np

from jaxllm.data.tokenizer import Tokenizer
from jaxllm.serve.engine import Engine
from jaxllm.serve.generation import TOP_LOGPROBS, Limits, Tokens
from jaxllm.serve.settings import ServeConfig


class FakeDevice:
    bandwidth = 1e9

    def __init__(self, slots: int, vocab_size: int):
        self.slots, self.vocab_size = slots, vocab_size
        self.reset()

    def reset(self) -> None:
        self.last = np.zeros(self.slots + 1, np.int64)
        self.sampling = np.zeros((self.slots + 1, 3))  # temperature, seed, choice

    def _draw(self, slot: int, index: int, position: int, allowed: np.ndarray) -> int:
        bits = np.unpackbits(allowed.view(np.uint8), bitorder="little")[: self.vocab_size]
        temperature, seed, choice = self.sampling[slot]
        key = [int(seed), int(choice), index] if temperature > 0 else [max(position, 0), int(self.last[slot])]
        return int(np.random.default_rng(key).choice(np.flatnonzero(bits)))

    def _tokens(self, ids: list[int]) -> Tokens:
        rows = len(ids)
        zeros = np.zeros((rows, TOP_LOGPROBS))
        return Tokens(np.array(ids), np.zeros(rows), zeros.astype(np.int32), zeros)

    def decode(self, batch) -> Tokens:
        rows = zip(batch.slots, batch.index, batch.positions, batch.allowed, strict=True)
        ids = [self._draw(slot, index, position, allowed) for slot, index, position, allowed in rows]
        self.last[batch.slots] = ids
        return self._tokens(ids)

    def prefill(self, batch) -> Tokens:
        ids = []
        for r, slot in enumerate(batch.slots):
            sampling = batch.sampling
            self.sampling[slot] = sampling.temperature[r], sampling.seed[r], sampling.choice[r]
            self.last[slot] = batch.tokens[r, batch.lengths[r] - 1]
            ids.append(self._draw(slot, batch.index[r], batch.starts[r] + batch.lengths[r] - 1, batch.allowed[r]))
            if batch.final[r]:
                self.last[slot] = ids[-1]
        return self._tokens(ids)

    def read(self, pending: Tokens) -> tuple[Tokens, None, None]:
        return pending, None, None  # no scored prompt; no prompt lookup's flags

    def decode_bytes(self, contexts: list[int]) -> float:
        return float(sum(contexts))


def fake_engine(tokenizer: Tokenizer, slots: int = 4, max_len: int = 1024, **settings) -> Engine:
    """An engine over a `FakeDevice`, every request within the limits of `tokenizer`'s vocabulary."""
    s = ServeConfig(slots=slots, max_len=max_len, kv_pages=slots * max_len // 16 + 1, **settings)
    limits = Limits(slots, max_len, max_len - 1, tokenizer.vocab_size)
    return Engine(FakeDevice(slots, tokenizer.vocab_size), s, limits, tokenizer)

"""The shapes the serving engine's device steps come in, each compiled once when it starts."""

from __future__ import annotations

import dataclasses

MIN_WIDTH = 256  # tokens the narrowest table covers: reading fewer saves little next to the weights


def _doubling(start: int, top: int) -> list[int]:
    sizes = [start]
    while sizes[-1] * 2 < top:
        sizes.append(sizes[-1] * 2)
    return sorted({*(s for s in sizes if s < top), top})


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The shapes the engine compiles: decode batches of `rows` (powers of two up to the slots);
    tables of `pages` pages (a doubling from `MIN_WIDTH` tokens up to `serve.max_len`); prefill
    chunks of `chunks` tokens (a doubling from 16 up to `serve.prefill_chunk`), each in the row
    buckets that fit the token budget."""

    rows: list[int]
    pages: list[int]
    chunks: list[int]
    budget: int  # prefill tokens per step

    @classmethod
    def of(cls, slots: int, max_len: int, page_size: int, prefill_chunk: int) -> Buckets:
        max_pages = -(-max_len // page_size)
        pages = _doubling(min(max_pages, max(1, MIN_WIDTH // page_size)), max_pages)
        chunk = min(prefill_chunk, max_len)
        return cls(_doubling(1, slots), pages, _doubling(min(16, chunk), chunk), chunk)

    def prefill_rows(self, chunk: int) -> list[int]:
        """The row buckets of a prefill of `chunk`-token pieces: as many as fit the token budget."""
        return [r for r in self.rows if r <= max(1, self.budget // chunk)]

    @staticmethod
    def fit(size: int, sizes: list[int]) -> int:
        return next(s for s in sizes if s >= size)

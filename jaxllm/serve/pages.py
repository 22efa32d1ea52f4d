"""The KV cache's pages as the host keeps them: which are free, how many sequences hold each, and
the prefix cache, a map from the tokens a full page holds (and every token before it) to the page.

A full page of a prompt is known by a chained hash: its tokens, the hash of the page before, and a
salt naming the model, dtype and KV dtype, so two prompts share a page only if they share every
token up to its end. A page cached this way is shared read-only: sequences that start with the same
tokens take a reference to it instead of prefilling them again, and no sequence writes into a full
page of its prompt. Once no sequence holds it, a cached page stays where it is (idle) until the pool
needs it back, least recently used first. Page 0 is the device's scratch page and is never handed out.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

SCRATCH_PAGE = 0  # `model.cache.SCRATCH_PAGE`, named here too so the host side needs no JAX


class PagePool:
    """`pages` pages of `page_size` positions (page 0 kept back as scratch); with `prefix_cache`
    off, no page is ever shared."""

    def __init__(self, pages: int, page_size: int, salt: str, prefix_cache: bool):
        self.page_size, self.capacity, self.prefix_cache = page_size, pages - 1, prefix_cache
        self._salt = hashlib.blake2b(salt.encode(), digest_size=16).digest()
        self._free = list(range(pages - 1, 0, -1))  # popped from the end: low ids first
        self._holders = [0] * pages  # sequences holding each page
        self._cached: dict[bytes, int] = {}  # a full page's chained hash → the page
        self._hash_of: dict[int, bytes] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unheld, LRU first

    def available(self) -> int:
        """Pages a sequence could take now: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    def in_use(self) -> int:
        """Pages some sequence holds."""
        return self.capacity - self.available()

    def cached(self) -> int:
        return len(self._cached)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def _hashes(self, tokens: list[int], pages: int) -> list[bytes]:
        hashes, previous, ps = [], self._salt, self.page_size
        for i in range(pages):
            page = np.asarray(tokens[i * ps : (i + 1) * ps], np.int64).tobytes()
            previous = hashlib.blake2b(previous + page, digest_size=16).digest()
            hashes.append(previous)
        return hashes

    def share(self, tokens: list[int]) -> list[int]:
        """The cached pages that hold `tokens`' first full pages, each now held once more; never
        the page of the last token, whose logits the sequence still has to compute."""
        wanted = (len(tokens) - 1) // self.page_size
        found = []
        for h in self._hashes(tokens, wanted):
            if (page := self._cached.get(h)) is None:
                break
            found.append(page)
        for page in found:
            self._hold(page)
        return found

    def take(self, count: int) -> list[int] | None:
        """`count` pages for one sequence to write into (reclaiming idle cached pages, least
        recently used first), or None, taking none, if fewer are available."""
        if count > self.available():
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                del self._cached[self._hash_of.pop(page)]
            pages.append(page)
            self._hold(page)
        return pages

    def release(self, pages: list[int]) -> None:
        """A sequence lets go of its pages: a cached one turns idle (most recently used), any
        other free."""
        for page in reversed(pages):  # a prompt's later pages are evicted first
            self._holders[page] -= 1
            if self._holders[page] == 0:
                if page in self._hash_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def remember(self, tokens: list[int], pages: list[int]) -> None:
        """Caches the full pages of `tokens`, whose keys and values `pages` now hold (or will, by
        the time a later step reads them: device steps run in order)."""
        if not self.prefix_cache:
            return
        full = len(tokens) // self.page_size
        for h, page in zip(self._hashes(tokens, full), pages[:full], strict=True):
            if h not in self._cached and page not in self._hash_of:
                self._cached[h], self._hash_of[page] = page, h

    def forget(self) -> None:
        """Drops the prefix cache (the device's pages were lost); held pages stay held."""
        for page in self._idle:
            self._free.append(page)
        self._idle.clear()
        self._cached.clear()
        self._hash_of.clear()

    def _hold(self, page: int) -> None:
        self._holders[page] += 1
        self._idle.pop(page, None)

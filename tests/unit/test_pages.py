"""The page pool and prefix cache on the host: pages are handed out once, shared only for equal
token prefixes under the same salt, kept when idle until the pool needs them (least recently
used first), and never the scratch page."""

from jaxllm.serve.pages import PagePool


def _pool(pages=9, cache=True, salt="model|float32|float32"):
    return PagePool(pages, page_size=4, salt=salt, prefix_cache=cache)


def test_pages_are_taken_once_never_the_scratch_page_and_come_back():
    pool = _pool()
    first = pool.take(5)
    assert sorted(first) == [1, 2, 3, 4, 5] and pool.available() == 3 and pool.in_use() == 5
    assert pool.take(4) is None and pool.available() == 3  # refused whole, nothing taken
    rest = pool.take(3)
    assert set(first).isdisjoint(rest) and 0 not in first + rest and pool.available() == 0
    pool.release(first + rest)
    assert pool.available() == 8 and pool.in_use() == 0


def test_a_prompts_full_pages_are_shared_but_never_its_last_token():
    pool, prompt = _pool(), list(range(10))  # two full pages of 4, and 2 tokens
    pages = pool.take(3)
    pool.remember(prompt, pages)
    assert pool.cached() == 2
    assert pool.share(prompt) == pages[:2]
    assert pool.share(prompt[:8]) == pages[:1]  # the second page holds the last token: computed again
    assert pool.share([0, 1, 2, 99, 4, 5, 6, 7, 8]) == []  # one token differs in the first page
    assert pool.share([0, 1, 2, 3, 4, 5, 6, 99, 8]) == pages[:1]  # ... in the second: the first is shared
    assert _pool(salt="another model").share(prompt) == []


def test_idle_cached_pages_stay_until_needed_least_recently_used_first():
    pool = _pool()
    a, b = pool.take(2), pool.take(2)
    pool.remember(list(range(8)), a)
    pool.remember(list(range(100, 108)), b)
    pool.release(a)
    pool.release(b)
    assert pool.available() == 8 and pool.cached() == 4
    assert pool.share(list(range(9))) == a  # used again: now the most recent
    pool.release(a)
    fresh = pool.take(6)  # the 4 free pages, then b's (least recently used), not a's
    assert set(b) <= set(fresh) and set(a).isdisjoint(fresh)
    assert pool.share(list(range(100, 109))) == [] and pool.share(list(range(9))) == a


def test_shared_pages_are_held_by_each_sharer_and_forgetting_frees_only_idle_ones():
    pool = _pool()
    pages = pool.take(2)
    pool.remember(list(range(8)), pages)
    shared = pool.share(list(range(9)))
    pool.release(pages)
    assert pool.in_use() == 2  # still held by the sharer
    pool.release(shared)
    assert pool.in_use() == 0 and pool.cached() == 2
    pool.forget()
    assert pool.cached() == 0 and pool.available() == 8 and pool.share(list(range(9))) == []


def test_without_the_prefix_cache_nothing_is_remembered():
    pool = _pool(cache=False)
    pages = pool.take(2)
    pool.remember(list(range(8)), pages)
    assert pool.cached() == 0 and pool.share(list(range(9))) == []


def test_a_page_is_known_by_every_token_before_it_not_only_its_own():
    """The same tokens after a different first page are another page: the chained hash."""
    pool = _pool()
    other, mine = pool.take(2), pool.take(2)
    pool.remember([9, 9, 9, 9, 4, 5, 6, 7], other)
    pool.remember(list(range(8)), mine)
    assert pool.share(list(range(9))) == mine
    assert pool.share([9, 9, 9, 9, 4, 5, 6, 7, 8]) == other

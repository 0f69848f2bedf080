import pytest

from tpuserve.kv_cache.block_pool import BlockPool
from tpuserve.kv_cache.layout import RESERVED_PAGE


def test_allocate_free_accounting_and_reserved_page():
    pool = BlockPool(num_pages=6, page_size=4)
    assert pool.num_free == 5
    got = pool.allocate(3)
    assert len(got) == 3 and RESERVED_PAGE not in got and pool.num_free == 2
    assert pool.allocate(3) is None and pool.num_free == 2  # all-or-nothing
    pool.free(got)
    assert pool.num_free == 5 and pool.usage() == 0.0
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(got[:1])


def test_pages_needed_rounds_up():
    pool = BlockPool(num_pages=8, page_size=4)
    assert pool.pages_needed(1, 0) == 1
    assert pool.pages_needed(4, 1) == 0
    assert pool.pages_needed(5, 1) == 1
    assert pool.pages_needed(9, 0) == 3


def _cached_pool(num_pages=6, **kw):
    return BlockPool(num_pages=num_pages, page_size=4, enable_caching=True, **kw)


def test_registered_pages_are_shared_and_survive_their_last_free():
    pool = _cached_pool()
    a = pool.allocate(2)
    assert pool.register(a[0], b"h0") and pool.register(a[1], b"h1")
    assert pool.match([b"h0", b"h1", b"h2"]) == a  # longest cached prefix
    assert pool.match([b"h1"]) == [a[1]] and pool.match([b"x", b"h1"]) == []
    pool.acquire(a)  # a second holder
    assert [pool.ref_count(p) for p in a] == [2, 2]
    pool.free(reversed(a))
    pool.free(reversed(a))
    assert pool.num_free == 5 and pool.num_cached == 2  # free, yet still findable
    pool.acquire(pool.match([b"h0"]))  # a hit revives a free cached page
    assert pool.num_free == 4 and pool.ref_count(a[0]) == 1


def test_register_keeps_the_first_copy_and_needs_a_held_page():
    pool = _cached_pool()
    a, b = pool.allocate(1), pool.allocate(1)
    assert pool.register(a[0], b"h")
    assert not pool.register(b[0], b"h")  # computed twice concurrently: the first copy wins
    assert pool.match([b"h"]) == a and pool.page_hash(b[0]) is None
    pool.free(b)
    with pytest.raises(RuntimeError, match="not held"):
        pool.register(b[0], b"other")
    with pytest.raises(RuntimeError, match="not a cached page"):
        pool.acquire(b)


def test_eviction_order_uncached_first_then_lru_tail_first():
    pool = _cached_pool(num_pages=7, record_evictions=True)  # 6 usable
    seq1 = pool.allocate(3)
    for i, p in enumerate(seq1):
        pool.register(p, b"a%d" % i)
    seq2 = pool.allocate(2)
    pool.register(seq2[0], b"b0")  # seq2's second page stays private (a partial page)
    pool.free(reversed(seq1))
    pool.free(reversed(seq2))
    # Never-registered pages go first (the spare page and seq2's private one), then the least
    # recently freed cached pages, each sequence's tail before its head.
    first = pool.allocate(2)
    assert set(first) == {p for p in range(1, 7) if p not in seq1 and p != seq2[0]}
    assert pool.take_evicted() == []
    nxt = pool.allocate(3)
    assert nxt == [seq1[2], seq1[1], seq1[0]]
    assert pool.take_evicted() == [(b"a2", seq1[2]), (b"a1", seq1[1]), (b"a0", seq1[0])]
    assert pool.match([b"a0"]) == [] and pool.match([b"b0"]) == [seq2[0]]
    assert pool.take_evicted() == []


def test_caching_off_matches_nothing_and_reset_forgets_free_pages():
    off = BlockPool(num_pages=4, page_size=4)
    p = off.allocate(1)
    assert not off.register(p[0], b"h") and off.match([b"h"]) == []
    pool = _cached_pool()
    held, free = pool.allocate(1), pool.allocate(1)
    pool.register(held[0], b"held")
    pool.register(free[0], b"free")
    pool.free(free)
    assert pool.reset_cache() == 1
    assert pool.match([b"free"]) == [] and pool.match([b"held"]) == held

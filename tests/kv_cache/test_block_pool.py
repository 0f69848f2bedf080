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

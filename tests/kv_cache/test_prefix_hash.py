"""Page hashes: a chain over full pages, so equal prefixes share hashes and nothing else does."""

import hashlib
import pickle

from tpuserve.kv_cache.prefix_hash import ROOT_HASH, extend_page_hashes, hash_page, page_hashes


def test_hash_is_sha256_of_the_pickled_chain_link():
    tokens = [5, 6, 7, 8]
    want = hashlib.sha256(pickle.dumps((ROOT_HASH, (5, 6, 7, 8), ()), pickle.HIGHEST_PROTOCOL)).digest()
    assert hash_page(None, tokens) == want
    assert page_hashes(tokens + [9, 10, 11, 12], 4)[1] == hash_page(want, [9, 10, 11, 12])


def test_equal_prefixes_share_hashes_and_a_difference_changes_every_later_one():
    a = list(range(40))
    b = a[:21] + [999] + a[22:]
    ha, hb = page_hashes(a, 8), page_hashes(b, 8)
    assert len(ha) == 5  # full pages only
    assert ha[:2] == hb[:2]  # pages 0-1 equal; page 2 holds the change at position 21
    assert all(x != y for x, y in zip(ha[2:], hb[2:]))
    assert len(page_hashes(a[:15], 8)) == 1  # the partial page is not hashed


def test_salt_separates_every_page_and_extension_is_incremental():
    a = list(range(32))
    plain, salted, other = page_hashes(a, 8), page_hashes(a, 8, "s1"), page_hashes(a, 8, "s2")
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain, salted, other))
    grown = extend_page_hashes(page_hashes(a[:17], 8, "s1"), a, 8, "s1")
    assert grown == salted

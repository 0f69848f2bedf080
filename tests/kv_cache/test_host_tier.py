"""The host tier: pages saved to host memory come back bitwise, LRU and pins behave, programs stay few.

Oracle: copies of the device pages taken with ``np.asarray`` before anything moves (no host-tier
code involved), compared with what a load writes into other pages of another cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.kv_cache.host_tier import (
    HostKVTier,
    HostPagePool,
    HostSlotIndex,
    host_memory_kind,
    page_bytes,
    slots_for_bytes,
)

pytestmark = pytest.mark.timeout(120)

L, P, PS, D = 2, 16, 4, 8


def _cache(c: int = 4, dtype=jnp.float32, seed: int = 0):
    """A [L, P, PS, c, D] cache of distinct random values (padding heads included)."""
    x = np.random.default_rng(seed).standard_normal((L, P, PS, c, D)).astype(np.float32)
    return jnp.asarray(x, dtype)


def _h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def _tier(cache, pages: int, **kw) -> HostKVTier:
    return HostKVTier(pages * page_bytes(cache.shape, cache.dtype), cache.shape, cache.dtype, **kw)


@pytest.mark.parametrize(
    "c,dtype",
    [(4, jnp.float32), (16, jnp.bfloat16), (32, jnp.float8_e4m3fn)],
    ids=["f32-unpadded", "bf16-tpu-padded-C", "fp8-tpu-padded-C"],
)
def test_save_then_load_into_other_pages_is_bitwise_equal(c, dtype):
    kv = _cache(c, dtype)
    want = {p: np.asarray(kv[:, p]) for p in (3, 5, 9)}
    tier = _tier(kv, pages=8)
    tier.save(kv, [(_h(p), p) for p in (3, 5, 9)])
    assert tier.stats.saved_pages == 3 and tier.stats.bytes_saved == 3 * tier.page_bytes
    target = jnp.zeros_like(kv)
    dest = {3: 11, 5: 1, 9: 14}
    out = tier.load(target, [(_h(p), d) for p, d in dest.items()])
    assert target.is_deleted()  # donated: one in-place update
    got = np.asarray(out)
    for p, d in dest.items():
        assert got[:, d].tobytes() == want[p].tobytes()
    untouched = [q for q in range(P) if q not in dest.values()]
    assert not got[:, untouched].any()  # padding rows of the bucket were dropped, not written
    assert tier.stats.loaded_pages == 3 and tier.stats.bytes_loaded == 3 * tier.page_bytes


def test_host_memory_kind_is_used_on_cpu():
    assert host_memory_kind(jax.devices()[0]) == "pinned_host"
    kv = _cache()
    pool = HostPagePool(4, (L, PS, 4, D), kv.dtype)
    pool.save(kv, [0], [2])
    assert pool._pending[0].host_pages.sharding.memory_kind == "pinned_host"


def test_saves_survive_the_cache_being_donated_right_after():
    kv = _cache(seed=1)
    want = np.asarray(kv[:, 7])
    tier = _tier(kv, pages=4, max_inflight_saves=8)
    tier.save(kv, [(_h(7), 7)])
    # The next "step" overwrites every page through a donated buffer, dispatched at once.
    step = jax.jit(lambda x: x * 0 - 1, donate_argnums=(0,))
    kv = step(kv)
    assert tier.pool.num_inflight == 1  # the copy was not forced before the step was dispatched
    out = tier.load(kv, [(_h(7), 2)])
    assert np.asarray(out)[:, 2].tobytes() == want.tobytes()


def test_lru_eviction_when_full_without_errors():
    kv = _cache(seed=2)
    tier = _tier(kv, pages=3)
    for p in (1, 2, 3):
        tier.save(kv, [(_h(p), p)])
    assert tier.match([_h(1)]) == 1  # page 1 becomes most recently used
    tier.save(kv, [(_h(4), 4), (_h(5), 5)])  # evicts 2 then 3, the least recently used
    assert [p for p in range(1, 6) if _h(p) in tier] == [1, 4, 5]
    assert tier.stats.evicted_pages == 2 and len(tier) == 3
    out = np.asarray(tier.load(jnp.zeros_like(kv), [(_h(1), 8), (_h(4), 9), (_h(5), 10)]))
    ref = np.asarray(kv)
    for p, d in ((1, 8), (4, 9), (5, 10)):
        assert out[:, d].tobytes() == ref[:, p].tobytes()


def test_more_new_pages_than_slots_in_one_save_keeps_the_last():
    kv = _cache(seed=3)
    tier = _tier(kv, pages=2)
    tier.save(kv, [(_h(p), p) for p in (1, 2, 3, 4, 5)])
    assert [p for p in range(1, 6) if _h(p) in tier] == [4, 5]
    out = np.asarray(tier.load(jnp.zeros_like(kv), [(_h(4), 1), (_h(5), 2)]))
    assert out[:, 1].tobytes() == np.asarray(kv[:, 4]).tobytes()
    assert out[:, 2].tobytes() == np.asarray(kv[:, 5]).tobytes()


def test_a_slot_rewritten_before_its_first_copy_landed_loads_the_newer_page():
    kv = _cache(seed=4)
    tier = _tier(kv, pages=1, max_inflight_saves=8)
    tier.save(kv, [(_h(1), 1)])
    tier.save(kv, [(_h(2), 2)])  # same slot, both copies still in flight
    assert _h(1) not in tier and tier.pool.num_inflight == 2
    out = np.asarray(tier.load(jnp.zeros_like(kv), [(_h(2), 3)]))
    assert out[:, 3].tobytes() == np.asarray(kv[:, 2]).tobytes()


def test_pinned_pages_are_not_evicted_and_a_fully_pinned_tier_skips_saves():
    kv = _cache(seed=5)
    tier = _tier(kv, pages=2)
    tier.save(kv, [(_h(1), 1), (_h(2), 2)])
    tier.pin([_h(1)])
    tier.save(kv, [(_h(3), 3)])
    assert _h(1) in tier and _h(2) not in tier and _h(3) in tier
    tier.pin([_h(3)])
    tier.save(kv, [(_h(4), 4)])  # every slot pinned: not saved, no error
    assert _h(4) not in tier and tier.stats.saved_pages == 3
    tier.unpin([_h(1), _h(3)])
    tier.save(kv, [(_h(4), 4)])
    assert _h(4) in tier and _h(1) not in tier
    with pytest.raises(RuntimeError, match="unpinned more often"):
        tier.unpin([_h(3)])


def test_load_of_an_absent_hash_raises_naming_it():
    kv = _cache()
    tier = _tier(kv, pages=2)
    tier.save(kv, [(_h(1), 1)])
    with pytest.raises(KeyError, match=_h(9).hex()):
        tier.load(kv, [(_h(1), 2), (_h(9), 3)])
    assert not kv.is_deleted()  # nothing dispatched


def test_match_counts_leading_hashes_only():
    kv = _cache()
    tier = _tier(kv, pages=4)
    tier.save(kv, [(_h(1), 1), (_h(3), 3)])
    assert tier.match([_h(1), _h(2), _h(3)]) == 1
    assert tier.match([_h(2), _h(1)]) == 0
    assert tier.match([_h(1), _h(3)]) == 2
    assert tier.match([]) == 0
    assert tier.stats.hit_pages == 3


def test_compiled_programs_stay_bounded_across_many_sizes():
    kv = _cache(seed=6)
    tier = _tier(kv, pages=P)
    for n in range(1, 16):
        pages = list(range(1, n + 1))
        tier.save(kv, [(_h(1000 * n + p), p) for p in pages])
        kv = tier.load(kv, [(_h(1000 * n + p), P - p) for p in pages])
    tier.wait()
    # Index counts pad to 1, 2, 4, 8, 16: five gathers and five scatters, whatever the sizes.
    assert tier.compile_count <= 10, tier.compile_count


def test_inflight_saves_are_bounded_and_wait_drains_them():
    kv = _cache(seed=7)
    tier = _tier(kv, pages=P, max_inflight_saves=2)
    for p in range(1, 8):
        tier.save(kv, [(_h(p), p)])
        assert tier.pool.num_inflight <= 2
    tier.wait()
    assert tier.pool.num_inflight == 0
    slot = tier.index.slot(_h(5))
    assert tier.pool.slots[slot].tobytes() == np.asarray(kv[:, 5]).tobytes()


def test_bad_input_is_refused_clearly():
    kv = _cache()
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        HostKVTier(page_bytes(kv.shape, kv.dtype) - 1, kv.shape, kv.dtype)
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        slots_for_bytes(0, 100)
    tier = _tier(kv, pages=4)
    with pytest.raises(ValueError, match="out of range"):
        tier.save(kv, [(_h(1), P)])
    assert _h(1) not in tier  # the index was left as it was
    with pytest.raises(ValueError, match="does not hold pages"):
        tier.save(jnp.zeros((L, P, PS, 2, D)), [(_h(1), 1)])
    tier.save(kv, [(_h(1), 1), (_h(2), 2)])
    with pytest.raises(ValueError, match="twice"):
        tier.load(kv, [(_h(1), 3), (_h(2), 3)])


def test_slot_index_alone_is_plain_bookkeeping():
    idx = HostSlotIndex(2)
    assert idx.insert(_h(1)) == (0, None) and idx.insert(_h(2)) == (1, None)
    assert idx.insert(_h(3)) == (0, _h(1))
    with pytest.raises(ValueError, match="already"):
        idx.insert(_h(3))
    idx.remove(_h(3))
    assert _h(3) not in idx and idx.insert(_h(4)) == (0, None)


def test_one_host_page_can_fill_several_device_pages():
    kv = _cache(seed=8)
    pool = HostPagePool(2, (L, PS, 4, D), kv.dtype)
    pool.save(kv, [1], [6])
    out = np.asarray(pool.load(jnp.zeros_like(kv), [1, 1], [2, 3]))
    want = np.asarray(kv[:, 6]).tobytes()
    assert out[:, 2].tobytes() == want and out[:, 3].tobytes() == want
    with pytest.raises(ValueError, match="twice"):
        pool.save(kv, [0, 0], [1, 2])


def test_warmup_compiles_every_bucket_and_touches_nothing():
    kv = _cache(seed=9)
    ref = np.asarray(kv)
    pool = HostPagePool(P, (L, PS, 4, D), kv.dtype)
    kv = pool.warmup(kv, 5)  # buckets 1, 2, 4, 8
    assert pool.compile_count == 8
    assert np.asarray(kv).tobytes() == ref.tobytes()
    pool.save(kv, list(range(7)), list(range(1, 8)))
    kv = pool.load(kv, [0, 1, 2], [9, 10, 11])
    assert pool.compile_count == 8  # nothing new after warm-up


@pytest.mark.parametrize("committed", [False, True])
def test_load_keeps_the_caches_commitment(committed):
    # The model step compiles once per commitment of its cache argument: a load that handed back a
    # committed cache for an uncommitted one recompiled every step shape after it.
    kv = _cache(seed=10)
    if committed:
        kv = jax.device_put(kv, jax.devices()[0])
    assert kv.committed is committed
    pool = HostPagePool(4, (L, PS, 4, D), kv.dtype)
    kv = pool.warmup(kv, 2)
    assert kv.committed is committed
    pool.save(kv, [0, 1], [3, 4])
    kv = pool.load(kv, [0, 1], [5, 6])
    assert kv.committed is committed

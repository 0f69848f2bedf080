"""Device cache <-> host pages: gathered pages equal the cache's, scattered pages land bitwise, and
a whole producer -> TCP -> consumer round trip between two device caches is exact.

Oracle: ``np.asarray(kv)[:, ids]`` taken before anything moves (no code under test involved).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.kv_cache.transfer.device_pages import DevicePageMover, HostPages
from tpuserve.kv_cache.transfer.layout import KVLayout
from tpuserve.kv_cache.transfer.tcp import TcpKVReceiver, TcpKVSender

pytestmark = pytest.mark.timeout(120)

L, P, PS, C, D = 2, 16, 4, 4, 8
SECRET = "device-pages-test-secret"


def _cache(dtype, seed: int, c: int = C):
    """A cache of random bit patterns (NaNs, -0.0, subnormals included) viewed as ``dtype``."""
    n = L * P * PS * c * D * np.dtype(dtype).itemsize
    bits = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return jnp.asarray(bits.view(np.dtype(dtype)).reshape(L, P, PS, c, D))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gather_then_scatter_into_other_pages_is_bitwise(dtype):
    kv = _cache(dtype, 0)
    ids = [3, 9, 1, 14, 6]  # 5 pages: padded to a bucket of 8
    want = np.asarray(kv)[:, ids]
    mover = DevicePageMover()
    host = mover.gather(kv, ids)
    assert isinstance(host, HostPages) and host.num_pages == 5
    assert host.array.sharding.memory_kind == "pinned_host"
    got = host.numpy()
    assert got.shape == (L, 5, PS, C, D) and got.tobytes() == want.tobytes()

    target = jnp.zeros_like(kv)
    dest = [11, 2, 5, 7, 15]
    out = mover.scatter(target, got, dest)
    assert target.is_deleted()  # donated: one in-place update
    out_np = np.asarray(out)
    assert out_np[:, dest].tobytes() == want.tobytes()
    untouched = [p for p in range(P) if p not in dest]
    assert not out_np[:, untouched].view(np.uint8).any()  # padding rows were dropped


def test_gather_survives_the_pages_being_overwritten_right_after():
    kv = _cache(jnp.float32, 1)
    want = np.asarray(kv)[:, [4, 5]]
    mover = DevicePageMover()
    host = mover.gather(kv, [4, 5])
    kv = jax.jit(lambda x: x * 0 - 1, donate_argnums=(0,))(kv)  # the next "step" reuses the pages
    assert host.numpy().tobytes() == want.tobytes()


def test_warmup_compiles_every_bucket_once():
    kv = _cache(jnp.float32, 2)
    mover = DevicePageMover()
    kv = mover.warmup(kv, 8)
    n = mover.compile_count
    assert n == 8  # gather + scatter for buckets 1, 2, 4, 8
    for k in (1, 3, 5, 8):
        kv = mover.scatter(kv, mover.gather(kv, list(range(1, k + 1))).numpy(), list(range(8, 8 + k)))
    assert mover.compile_count == n


def test_scatter_refuses_bad_input():
    kv = _cache(jnp.float32, 3)
    mover = DevicePageMover()
    pages = np.zeros((L, 2, PS, C, D), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        mover.scatter(kv, pages, [1, P])
    with pytest.raises(ValueError, match="twice"):
        mover.scatter(kv, pages, [2, 2])
    with pytest.raises(ValueError, match="do not fit"):
        mover.scatter(kv, pages, [1, 2, 3])
    with pytest.raises(ValueError, match="dtype"):
        mover.scatter(kv, pages.astype(np.float16), [1, 2])


@pytest.mark.parametrize("dtype,c", [(jnp.float32, 4), (jnp.bfloat16, 16)], ids=["f32", "bf16-padded-C"])
def test_device_to_device_through_the_tcp_transport(dtype, c):
    """Producer cache -> gather -> offer (lazy host pages) -> pull -> scatter -> consumer cache."""
    src, dst = _cache(dtype, 4, c), jnp.zeros((L, P, PS, c, D), dtype)
    layout = KVLayout.from_cache_shape("tiny", src.shape, src.dtype)
    ids, dest = [2, 7, 12], [5, 1, 9]
    want = np.asarray(src)[:, ids]
    mover = DevicePageMover()
    with TcpKVSender(layout, secret=SECRET) as sender:
        handle = sender.offer("req", mover.gather(src, ids), num_tokens=11)
        batch = TcpKVReceiver(layout, secret=SECRET).pull(handle, timeout_s=30)
        out = np.asarray(DevicePageMover().scatter(dst, batch.pages, dest))
        assert [e.reason for e in sender.drain_finished()] == ["pulled"]
    assert out[:, dest].tobytes() == want.tobytes()


@pytest.mark.parametrize("committed", [False, True])
def test_scatter_keeps_the_caches_commitment(committed):
    # A transferred prefill must not hand the model step a cache of another commitment (a recompile).
    kv = _cache(jnp.float32, 4)
    if committed:
        kv = jax.device_put(kv, jax.devices()[0])
    assert kv.committed is committed
    mover = DevicePageMover()
    kv = mover.warmup(kv, 2)
    assert kv.committed is committed
    kv = mover.scatter(kv, mover.gather(kv, [1, 2]).numpy(), [5, 6])
    assert kv.committed is committed

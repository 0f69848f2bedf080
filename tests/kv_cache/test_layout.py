"""KV cache shapes per attention implementation and the spec's sizing / allocation."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.attention.dispatch import kv_cache_shape, split_kv
from tpuserve.attention.kv_cache_shape import sublane_tile
from tpuserve.kv_cache.layout import KVCacheSpec

UNPADDED = ("reference", "blocked", "pallas_gpu")
TPU = ("pallas_tpu", "pallas_tpu_interpret")
F8 = jnp.float8_e4m3fn


def spec(num_kv_heads, dtype, layers=2, pages=5, page_size=4, head_dim=8):
    return KVCacheSpec(layers, pages, page_size, num_kv_heads, head_dim, dtype)


def test_sublane_tile_per_dtype():
    assert [sublane_tile(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, F8, jnp.int8)] == [
        8,
        16,
        16,
        32,
        32,
    ]
    assert sublane_tile("bfloat16") == 16 and sublane_tile(np.dtype("float32")) == 8


@pytest.mark.parametrize("impl", UNPADDED + TPU)
@pytest.mark.parametrize(
    "dtype,hkv,tpu_heads",
    [
        (jnp.float32, 1, 8),
        (jnp.float32, 4, 8),
        (jnp.float32, 5, 16),
        (jnp.bfloat16, 1, 16),
        (jnp.bfloat16, 3, 16),
        (jnp.bfloat16, 8, 16),
        (jnp.bfloat16, 12, 32),
        (F8, 1, 32),
        (F8, 16, 32),
        (F8, 20, 64),
    ],
)
def test_kv_cache_shape(impl, dtype, hkv, tpu_heads):
    s = spec(hkv, dtype)
    heads = tpu_heads if impl in TPU else 2 * hkv
    assert kv_cache_shape(impl, s) == (2, 5, 4, heads, 8) == s.shape_for(impl)
    itemsize = jnp.dtype(dtype).itemsize
    # The compiled kernel's row-major cache takes whole 128-lane rows on a TPU.
    lanes = 128 if impl == "pallas_tpu" else 8
    assert s.page_bytes(impl) == 2 * 4 * heads * lanes * itemsize
    assert s.bytes_per_page == 2 * 4 * 2 * hkv * 8 * itemsize  # payload, never padded
    assert s.shape == (2, 5, 4, 2 * hkv, 8)


@pytest.mark.parametrize("impl", ["auto", "nope"])
def test_kv_cache_shape_needs_a_concrete_impl(impl):
    with pytest.raises(ValueError, match="concrete attention impl"):
        kv_cache_shape(impl, spec(1, jnp.float32))


def test_allocate_per_impl():
    s = spec(3, jnp.bfloat16)
    cache = s.allocate("pallas_tpu_interpret")
    assert cache.shape == (2, 5, 4, 16, 8) and cache.dtype == jnp.bfloat16
    assert not np.asarray(cache, np.float32).any()
    assert s.allocate("blocked").shape == s.allocate().shape == (2, 5, 4, 6, 8)


def test_split_kv_drops_padding_heads():
    kv = jnp.arange(2 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 3)  # 2 real heads, 4 padding
    k, v = split_kv(kv, num_kv_heads=2)
    np.testing.assert_array_equal(k, kv[:, [0, 2]])
    np.testing.assert_array_equal(v, kv[:, [1, 3]])


def test_shape_module_imports_no_jax():
    """The engine and front ends size the KV cache before touching a device."""
    code = (
        "import sys; from tpuserve.attention.kv_cache_shape import kv_cache_shape, resolve_impl; "
        "assert resolve_impl('auto', 'tpu') == 'pallas_tpu'; "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

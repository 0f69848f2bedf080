"""The Pallas TPU kernel in TPU interpret mode (simulated DMAs, semaphores, race detection) on CPU.

Every case runs with ``pltpu.InterpretParams(detect_races=True)`` and checks: output == jnp
reference and == jax's ``ref_ragged_paged_attention`` (dtype tolerance), the written cache ==
``write_kv_ref`` exactly, and no race reported. Interpret mode costs ~8 ms per grid step and ~5 ms
per DMA, so the grids are tiny; a semaphore bug hangs, hence the timeouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
from jax.experimental.pallas import tpu as pltpu

from tpuserve.attention.dispatch import AttentionParams, ragged_paged_attention
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.attention.pallas_tpu import (default_block_sizes, ragged_paged_attention_tpu,
                                  ragged_paged_attention_tpu_stacked)
from tpuserve.kv_cache.layout import split_kv

import attention_cases as cases  # tests/attention/attention_cases.py

RACES = pltpu.InterpretParams(detect_races=True)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """A failed interpret run leaves global simulator state behind; start each test clean."""
    pltpu.reset_tpu_interpret_mode_state()
    yield
    pltpu.reset_tpu_interpret_mode_state()


def races_found() -> bool:
    """The interpreter's race verdict for the last kernel (jax keeps it in a module global)."""
    assert tpu_interpret.races is not None, "no kernel ran in TPU interpret mode"
    return bool(tpu_interpret.races.races_found)


def run_and_check(case, kwargs, dtype, **block):
    out, kv = ragged_paged_attention_tpu(
        case.queries, case.new_kv, case.kv_pages, *case.metadata, interpret=RACES, **block,
        **kwargs)
    jax.block_until_ready((out, kv))
    assert not races_found(), "the race detector reported a data race"
    want, want_kv = cases.expected(case, **kwargs)
    np.testing.assert_array_equal(cases.f32(kv), cases.f32(want_kv))
    np.testing.assert_allclose(cases.f32(out), cases.f32(want), **cases.tolerance(dtype))
    n = case.num_real_tokens
    np.testing.assert_allclose(cases.f32(out[:n]), cases.f32(cases.oracle(case, want_kv, **kwargs)),
                               **cases.tolerance(dtype))
    return out


# (num_queries_per_block, num_kv_pages_per_block) per shared case: bq=1 is the decode path, bq=3
# makes blocks straddle sequences at odd offsets, ppb=1 with a window makes the kernel skip blocks.
BLOCKS = {
    "decode_g8": (1, 2),
    "prefill_g1": (8, 2),
    "mixed_g3_d128": (4, 2),
    "window_g8": (4, 1),
    "soft_cap_g1": (3, 3),
    "bf16_g3_d128": (4, 2),
    "fp8_scales_g3": (4, 2),
}
SLOW = {"bf16_g3_d128", "prefill_g1"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in cases.CASES])
def test_kernel_matches_reference_and_oracle(name):
    case, kwargs, dtype = cases.build(name)
    bq, ppb = BLOCKS[name]
    run_and_check(case, kwargs, dtype, num_queries_per_block=bq, num_kv_pages_per_block=ppb)


@pytest.mark.timeout(300)
def test_decode_path_on_a_mixed_batch():
    """bq = 1 (one token per grid step) is correct for any batch, not only decodes."""
    case, kwargs, dtype = cases.build("window_g8", seed=3)
    run_and_check(case, kwargs, dtype, num_queries_per_block=1, num_kv_pages_per_block=3)


@pytest.mark.timeout(300)
def test_default_block_sizes():
    case, kwargs, dtype = cases.build("soft_cap_g1", seed=4)
    run_and_check(case, kwargs, dtype)


@pytest.mark.timeout(300)
def test_attend_without_writing():
    """new_kv=None: the cache comes back unchanged and attention reads it as is."""
    case, kwargs, dtype = cases.build("decode_g8", seed=5)
    out, kv = ragged_paged_attention_tpu(
        case.queries, None, case.kv_pages, *case.metadata, interpret=RACES,
        num_queries_per_block=2, num_kv_pages_per_block=2, **kwargs)
    jax.block_until_ready((out, kv))
    assert not races_found()
    np.testing.assert_array_equal(cases.f32(kv), cases.f32(case.kv_pages))
    want = cases.ragged_paged_attention_ref(case.queries, case.kv_pages, *case.metadata, **kwargs)
    np.testing.assert_allclose(cases.f32(out), cases.f32(want), **cases.tolerance(dtype))


@pytest.mark.timeout(300)
def test_dispatch_in_layer_scan():
    """dispatch 'pallas_tpu_interpret' == 'reference' the way the model calls it: a jitted
    lax.scan over layers of a stacked [L, ...] cache, the layer index traced."""
    case, kwargs, _ = cases.build("mixed_g3_d128", seed=6)
    other = jnp.asarray(np.random.default_rng(7).standard_normal(case.kv_pages.shape),
                        case.kv_pages.dtype)
    cache = jnp.stack([other, case.kv_pages])
    new_k, new_v = split_kv(case.new_kv)
    md = AttentionMetadata(*case.metadata)
    params = AttentionParams(**kwargs)

    def step(impl):
        def layer(c, i):
            # Each layer sees different K/V (scaled by its index) so a wrong layer shows up.
            scale = (i + 1).astype(new_k.dtype)
            out, c = ragged_paged_attention(case.queries, new_k * scale, new_v * scale, c, i, md,
                                            params, impl)
            return c, out
        run = jax.jit(lambda c: jax.lax.scan(layer, c, jnp.arange(2, dtype=jnp.int32)))
        return run(cache)

    got, out = step("pallas_tpu_interpret")
    want, want_out = step("reference")
    np.testing.assert_array_equal(cases.f32(got), cases.f32(want))
    np.testing.assert_allclose(cases.f32(out), cases.f32(want_out), atol=1e-4, rtol=1e-4)


def test_default_block_sizes_per_generation():
    assert default_block_sizes(16, 8, 8, "TPU v5 lite") == (1, 16)  # decode: one token per step
    assert default_block_sizes(16, 512, 8, "TPU v5 lite") == (32, 16)
    assert default_block_sizes(16, 512, 8, "TPU v6 lite") == (64, 32)
    assert default_block_sizes(128, 512, 8, "TPU7x") == (64, 8)
    assert default_block_sizes(16, 20, 8, "cpu") == (20, 32)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_tokens,kv_dtype,options", [
    (64, jnp.bfloat16, {}),
    (32, jnp.bfloat16, {}),  # tokens <= slots: the decode path (one token per grid step)
    (64, jnp.float8_e4m3fn, dict(k_scale=0.5, v_scale=2.0, soft_cap=30.0, sliding_window=128)),
], ids=["mixed_bf16", "decode_bf16", "fp8_window_cap"])
def test_lowers_to_mosaic(num_tokens, kv_dtype, options):
    """The kernel lowers to Mosaic for TPU (cross-platform, no TPU needed), at a Llama-8B-like
    shape with the default block sizes. Mosaic's own layout passes run only on a TPU."""
    slots, hq, hkv, d, layers, pages, ps, pps = 32, 32, 8, 128, 2, 1025, 16, 64
    args = (jax.ShapeDtypeStruct((num_tokens, hq, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((num_tokens, 2 * hkv, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((layers, pages, ps, 2 * hkv, d), kv_dtype),
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((slots,), jnp.int32),
            jax.ShapeDtypeStruct((slots, pps), jnp.int32),
            jax.ShapeDtypeStruct((slots + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    lowered = ragged_paged_attention_tpu_stacked.trace(*args, sm_scale=0.08, **options).lower(
        lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()

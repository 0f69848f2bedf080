"""The GPU path (Pallas, Triton lowering) run on CPU with ``interpret=True``.

Same shared cases as the TPU kernel: output == jnp reference and == jax's
``ref_ragged_paged_attention``, written cache == ``write_kv_ref``. Interpret mode checks the
kernel's indexing and math, not Triton lowering; benchmarks/attention_gpu.py checks the compiled
kernel on a GPU.
"""

from __future__ import annotations

import attention_cases as cases  # tests/attention/attention_cases.py
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.attention.dispatch import AttentionParams, ragged_paged_attention, split_kv
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.attention.pallas_gpu import (
    default_config,
    ragged_paged_attention_gpu,
    ragged_paged_attention_gpu_stacked,
)

# (rows_per_tile, pages_per_block, kv_splits) per case. page_size is 4, so 4 pages = 16 tokens,
# Triton's smallest dot; splits > 1 exercise the flash-decoding merge.
CONFIGS = {
    "decode_g8": (16, 4, 2),
    "prefill_g1": (16, 4, 1),
    "mixed_g3_d128": (16, 4, 2),
    "window_g8": (16, 4, 3),
    "soft_cap_g1": (32, 8, 1),
    "bf16_g3_d128": (16, 4, 1),
    "fp8_scales_g3": (16, 4, 2),
}


def run_and_check(case, kwargs, dtype, **config):
    out, kv = ragged_paged_attention_gpu(
        case.queries, case.new_kv, case.kv_pages, *case.metadata, interpret=True, **config, **kwargs
    )
    cases.check_step(case, kwargs, dtype, out, kv)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "bf16_g3_d128" else n for n in cases.CASES]
)
def test_gpu_path_matches_reference_and_oracle(name):
    case, kwargs, dtype = cases.build(name)
    rows, ppb, splits = CONFIGS[name]
    run_and_check(case, kwargs, dtype, rows_per_tile=rows, num_kv_pages_per_block=ppb, num_kv_splits=splits)


@pytest.mark.timeout(240)
def test_gpu_default_config():
    case, kwargs, dtype = cases.build("window_g8", seed=3)
    run_and_check(case, kwargs, dtype)


@pytest.mark.timeout(240)
def test_dispatch_pallas_gpu_stacked_cache():
    """dispatch 'pallas_gpu' on a 2-layer cache under jit == 'reference'; layer 0 untouched.

    On a CPU-only machine the GPU branch needs interpret mode, so the dispatch function is
    called with the kernel swapped for its interpret form.
    """
    import tpuserve.attention.dispatch as dispatch

    case, kwargs, _ = cases.build("decode_g8", seed=8)
    other = jnp.asarray(np.random.default_rng(9).standard_normal(case.kv_pages.shape), case.kv_pages.dtype)
    cache = jnp.stack([case.kv_pages, other])
    new_k, new_v = split_kv(case.new_kv)
    md = AttentionMetadata(*case.metadata)
    params = AttentionParams(**kwargs)

    def interpreted(*args, **kw):
        return ragged_paged_attention_gpu_stacked(*args, interpret=True, **kw)

    def step(impl):
        fn = jax.jit(
            lambda q, k, v, c, layer, md: ragged_paged_attention(q, k, v, c, layer, md, params, impl)
        )
        return fn(case.queries, new_k, new_v, cache, jnp.int32(0), md)

    original = dispatch.ragged_paged_attention_gpu_stacked
    dispatch.ragged_paged_attention_gpu_stacked = interpreted
    try:
        out, got = step("pallas_gpu")
    finally:
        dispatch.ragged_paged_attention_gpu_stacked = original
    want_out, want = step("reference")
    np.testing.assert_array_equal(cases.f32(got), cases.f32(want))
    np.testing.assert_array_equal(cases.f32(got[1]), cases.f32(other))
    np.testing.assert_allclose(cases.f32(out), cases.f32(want_out), atol=1e-4, rtol=1e-4)


def test_default_config_shapes():
    # decode at batch 128, GQA 4, 8 KV heads, 16-token pages, 32k context: 16-row tiles, 128-token
    # KV blocks, no split (128 tiles x 8 heads already fill the GPU).
    assert default_config(128, 128, 4, 8, 16, 2048) == (16, 8, 1)
    # batch 1 at 32k: split the context so ~264 programs run.
    assert default_config(1, 1, 4, 8, 16, 2048) == (16, 8, 33)
    # prefill chunk: 64-row tiles, 64-token KV blocks; f32 cache: half-size KV blocks.
    assert default_config(512, 8, 4, 8, 16, 64)[:2] == (64, 4)
    assert default_config(128, 128, 4, 8, 16, 2048, kv_itemsize=4)[1] == 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kv_dtype,options",
    [
        (jnp.bfloat16, dict(num_kv_splits=4)),
        (jnp.float8_e4m3fn, dict(k_scale=0.5, v_scale=2.0, soft_cap=30.0, sliding_window=128)),
    ],
    ids=["bf16_split", "fp8_window_cap"],
)
def test_lowers_to_triton(kv_dtype, options):
    """The kernel lowers through Pallas' Triton lowering (cross-platform, no GPU needed).

    This proves every op and shape is accepted by the lowering (power-of-two shapes, gathers,
    dynamic loops); Triton's own compile to PTX happens only on a GPU.
    """
    t, slots, hq, hkv, d, layers, pages, ps, pps = 32, 32, 32, 8, 128, 2, 1025, 16, 64
    args = (
        jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((t, 2 * hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((layers, pages, ps, 2 * hkv, d), kv_dtype),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots, pps), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    lowered = ragged_paged_attention_gpu_stacked.trace(*args, sm_scale=0.08, **options).lower(
        lowering_platforms=("cuda",)
    )
    assert "triton" in lowered.as_text()

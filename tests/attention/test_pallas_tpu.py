"""The Pallas TPU kernel in TPU interpret mode (simulated DMAs, semaphores, race detection) on CPU.

Every case runs with ``pltpu.InterpretParams(detect_races=True)`` and checks: output == jnp
reference and == jax's ``ref_ragged_paged_attention`` (dtype tolerance), the written cache ==
``write_kv_ref`` exactly, and no race reported. Interpret mode costs ~8 ms per grid step and ~5 ms
per DMA, so the grids are tiny; a semaphore bug hangs, hence the timeouts.
"""

from __future__ import annotations

import dataclasses

import attention_cases as cases  # tests/attention/attention_cases.py
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_interpret import RACES, fresh_interpreter, races_found  # noqa: F401 (autouse fixture)

from tpuserve.attention.dispatch import AttentionParams, kv_cache_shape, ragged_paged_attention, split_kv
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.attention.pallas_tpu import (
    _sees_whole_kv_block,
    default_block_sizes,
    ragged_paged_attention_tpu,
    ragged_paged_attention_tpu_stacked,
)
from tpuserve.kv_cache.layout import KVCacheSpec


def run_and_check(case, kwargs, dtype, **block):
    out, kv = ragged_paged_attention_tpu(
        case.queries, case.new_kv, case.kv_pages, *case.metadata, interpret=RACES, **block, **kwargs
    )
    jax.block_until_ready((out, kv))
    assert not races_found(), "the race detector reported a data race"
    cases.check_step(case, kwargs, dtype, out, kv)
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
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in cases.CASES]
)
def test_kernel_matches_reference_and_oracle(name):
    case, kwargs, dtype = cases.build(name)
    bq, ppb = BLOCKS[name]
    run_and_check(case, kwargs, dtype, num_queries_per_block=bq, num_kv_pages_per_block=ppb)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name",
    [
        "decode_g8",
        "window_g8",
        "soft_cap_g1",
        "fp8_scales_g3",
        pytest.param("bf16_g3_d128", marks=pytest.mark.slow),
    ],
)
def test_single_item_decode_path(name):
    """bq = 1 with a KV block as wide as the page table: each grid step is one item (its token's
    sequence, KV block 0) and takes the softmax at once, for decodes and any other batch."""
    case, kwargs, dtype = cases.build(name)
    pps = cases.SHAPES["pages_per_seq"]
    run_and_check(
        case, kwargs, dtype, num_queries_per_block=1, num_kv_pages_per_block=pps, single_item_decode=True
    )


@pytest.mark.parametrize("window", [None, 3, 7, 9])
def test_whole_kv_block_predicate_matches_the_mask(window):
    """``_sees_whole_kv_block`` is true exactly when the causal (+ window) mask of a query block's
    rows over a KV block is all true and every row is the sequence's: checked against the mask
    built row by row, over block offsets and sequence extents."""
    bq, kv_block = 4, 4
    seen = set()
    for q_start in range(-2, 3):
        for q_end in range(1, 7):
            for base in range(0, 14):
                for kv_first in range(0, 16, kv_block):
                    rows = [t for t in range(bq) if q_start <= t < q_end]
                    full = len(rows) == bq and all(
                        kv_first + j <= base + t and (window is None or kv_first + j > base + t - window)
                        for t in rows
                        for j in range(kv_block)
                    )
                    got = bool(_sees_whole_kv_block(q_start, q_end, base, kv_first, bq, kv_block, window))
                    assert got == full, (q_start, q_end, base, kv_first, window)
                    seen.add(full)
    # a window under bq + kv_block - 1 never shows a row a whole block
    assert seen == ({False} if window is not None and window < bq + kv_block - 1 else {True, False})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv_len,window", [(24, None), (22, None), (21, 8), (22, 9)])
def test_long_chunk_blocks_before_the_diagonal(kv_len, window):
    """A 12-token chunk ending at position kv_len - 1 in 4-query blocks over 4-token KV blocks: most
    items see their whole KV block and skip the mask; the output still equals the reference and the
    oracle. The offsets put KV blocks one position past a block's first row (22), so a predicate off
    by one shows."""
    case = cases.make_case(
        5,
        [(12, kv_len), (1, 9), (2, 5)],
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        num_tokens=16,
        **cases.SHAPES,
    )
    kwargs = dict(sm_scale=0.125) if window is None else dict(sm_scale=0.125, sliding_window=window)
    run_and_check(case, kwargs, jnp.float32, num_queries_per_block=4, num_kv_pages_per_block=1)


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
        case.queries,
        None,
        case.kv_pages,
        *case.metadata,
        interpret=RACES,
        num_queries_per_block=2,
        num_kv_pages_per_block=2,
        **kwargs,
    )
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
    other = jnp.asarray(np.random.default_rng(7).standard_normal(case.kv_pages.shape), case.kv_pages.dtype)
    cache = jnp.stack([other, case.kv_pages])
    new_k, new_v = split_kv(case.new_kv)
    md = AttentionMetadata(*case.metadata)
    params = AttentionParams(**kwargs)

    def step(impl):
        def layer(c, i):
            # Each layer sees different K/V (scaled by its index) so a wrong layer shows up.
            scale = (i + 1).astype(new_k.dtype)
            out, c = ragged_paged_attention(
                case.queries, new_k * scale, new_v * scale, c, i, md, params, impl
            )
            return c, out

        run = jax.jit(lambda c: jax.lax.scan(layer, c, jnp.arange(2, dtype=jnp.int32)))
        return run(cache)

    got, out = step("pallas_tpu_interpret")
    want, want_out = step("reference")
    np.testing.assert_array_equal(cases.f32(got), cases.f32(want))
    np.testing.assert_allclose(cases.f32(out), cases.f32(want_out), atol=1e-4, rtol=1e-4)


def test_default_block_sizes_per_generation():
    from tpuserve.attention import pallas_tpu

    assert default_block_sizes(16, 8, 8, "TPU v5 lite") == (1, 64)  # decode: one token per step
    assert default_block_sizes(16, 512, 8, "TPU v5 lite") == (128, 64)
    # More query heads than the 8B's 32 (at 128 lanes): fewer queries a block, the same VMEM
    assert default_block_sizes(16, 512, 8, "TPU v5 lite", num_q_heads=64) == (64, 64)
    assert default_block_sizes(16, 512, 8, "TPU v5 lite", num_q_heads=40, head_dim=64) == (64, 64)
    assert default_block_sizes(16, 512, 8, "TPU v5 lite", num_q_heads=8, head_dim=256) == (128, 32)
    assert default_block_sizes(16, 8, 8, "TPU v5p") == (1, 32)  # no decode-only size: the same
    assert default_block_sizes(16, 512, 8, "TPU v6 lite") == (64, 32)
    assert default_block_sizes(128, 512, 8, "TPU7x") == (64, 8)
    assert default_block_sizes(16, 20, 8, "cpu") == (20, 32)
    # Wide token rows get fewer tokens a block: 64 combined heads of head_dim 64 (a lane-padded
    # 128) overflowed the v5e's 16 MiB scoped VMEM at 512 tokens (SmolLM2-1.7B's shape).
    assert default_block_sizes(16, 512, 8, "TPU v5 lite", cache_heads=64, head_dim=64) == (128, 16)
    assert default_block_sizes(16, 8, 8, "TPU v5 lite", cache_heads=64, head_dim=64) == (1, 16)
    assert default_block_sizes(16, 8, 8, "TPU v5 lite", kv_itemsize=4) == (1, 32)
    # a GQA group of 8 (Qwen3-MoE's 32 q / 4 KV heads): half the tokens, the scores the chip compiled
    assert default_block_sizes(16, 512, 8, "TPU v5 lite", num_q_heads=32, num_kv_heads=4) == (128, 32)
    assert default_block_sizes(16, 8, 8, "TPU v5 lite", num_q_heads=32, num_kv_heads=4) == (1, 64)
    # the v5e's 1024-token prefill blocks compiled only with more than the default scoped VMEM
    assert pallas_tpu.generation_block_sizes("TPU v5 lite").vmem_limit_bytes == 64 << 20
    assert pallas_tpu.generation_block_sizes("cpu").vmem_limit_bytes is None


def _small_step_args(
    num_tokens: int, num_pages: int, slots: int = 8, hq: int = 8, hkv: int = 2, d: int = 128
):
    """Abstract kernel inputs of a small bf16 step (8 slots of 8 pages of 16 tokens)."""
    return (
        jax.ShapeDtypeStruct((num_tokens, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_tokens, 2 * hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, num_pages, 16, 2 * hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots, 8), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )


def _lowered_for_tpu(args, **kwargs) -> str:
    return (
        ragged_paged_attention_tpu_stacked.trace(*args, sm_scale=0.1, **kwargs)
        .lower(lowering_platforms=("tpu",))
        .as_text()
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("limit", [None, 48 << 20])
def test_generation_vmem_limit_reaches_the_kernel(monkeypatch, limit):
    """``vmem_limit_bytes=None`` (what the engine passes) asks Mosaic for the generation's scoped
    VMEM: without it the v5e's 1024-token prefill blocks do not compile."""
    from tpuserve.attention import pallas_tpu

    monkeypatch.setattr(
        pallas_tpu,
        "_FALLBACK_BLOCK_SIZES",
        dataclasses.replace(pallas_tpu._FALLBACK_BLOCK_SIZES, vmem_limit_bytes=limit),
    )
    # the jitted kernel reads the default at trace time: a shape per case, no cached trace
    text = _lowered_for_tpu(_small_step_args(64, 70 + (limit is None)))
    assert (str(48 << 20) in text) == (limit is not None)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "num_tokens,kv_dtype,options",
    [
        (64, jnp.bfloat16, {}),
        (32, jnp.bfloat16, {}),  # tokens <= slots: the decode path (one token per grid step)
        (64, jnp.float32, dict(k_scale=0.5, v_scale=2.0, soft_cap=30.0, sliding_window=128)),
        # every sequence's pages in one KV block: the single-item decode path
        (32, jnp.bfloat16, dict(num_kv_pages_per_block=64, sliding_window=128, single_item_decode=True)),
    ],
    ids=["mixed_bf16", "decode_bf16", "f32_scales_window_cap", "decode_bf16_one_block"],
)
def test_lowers_to_mosaic(num_tokens, kv_dtype, options):
    """The kernel lowers to Mosaic for TPU (cross-platform, no TPU needed), at a Llama-8B-like
    shape with the default block sizes. Mosaic's own layout passes run only on a TPU (which is
    where bf16's strided loads once failed: benchmarks/attention_tpu.py checks there)."""
    slots, hq, hkv, d, layers, pages, ps, pps = 32, 32, 8, 128, 2, 1025, 16, 64
    args = (
        jax.ShapeDtypeStruct((num_tokens, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_tokens, 2 * hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((layers, pages, ps, 2 * hkv, d), kv_dtype),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots, pps), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    lowered = ragged_paged_attention_tpu_stacked.trace(*args, sm_scale=0.08, **options).lower(
        lowering_platforms=("tpu",)
    )
    assert "tpu_custom_call" in lowered.as_text()
    # the kernel is named after its path: the one-item decode path only where asked and possible
    assert ("_one_item" in lowered.as_text()) == bool(options.get("single_item_decode"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("generation_default", [False, True])
def test_single_item_decode_unset_follows_the_generation(monkeypatch, generation_default):
    """``single_item_decode=None`` (what the engine passes) takes the one-item path exactly when
    the device generation's BlockSizes say so, on a 16-bit cache; CPU reads the fallback entry."""
    from tpuserve.attention import pallas_tpu

    assert (
        pallas_tpu.generation_block_sizes("TPU v5 lite") is pallas_tpu._BLOCK_SIZES_BY_GENERATION["v5 lite"]
    )
    assert pallas_tpu.generation_block_sizes("cpu") is pallas_tpu._FALLBACK_BLOCK_SIZES
    monkeypatch.setattr(
        pallas_tpu,
        "_FALLBACK_BLOCK_SIZES",
        dataclasses.replace(pallas_tpu._FALLBACK_BLOCK_SIZES, single_item_decode=generation_default),
    )
    # the jitted kernel reads the default at trace time: a shape per case, no cached trace
    args = _small_step_args(8, 65 + generation_default)
    text = _lowered_for_tpu(args)
    assert ("_one_item" in text) == generation_default
    # a 1-byte (FP8) cache keeps the general path unless asked: its one-item path is unmeasured
    fp8_args = list(args)
    fp8_args[2] = jax.ShapeDtypeStruct((1, 67 + generation_default, 16, 32, 128), jnp.uint8)
    for asked in (None, True):
        text = _lowered_for_tpu(fp8_args, kv_dtype=jnp.float8_e4m3fn, single_item_decode=asked)
        assert ("_one_item" in text) == bool(asked)


def test_compiled_kernel_refuses_a_cache_it_cannot_read_naming_the_dtype():
    # An FP8 cache is read (tests/attention/test_pallas_tpu_fp8.py); float16 has no unpacking, and
    # a 1-byte cache whose C is not whole 32-bit words cannot be read as words.
    def args(dtype, heads):
        return (
            jnp.zeros((8, 4, 64), jnp.bfloat16),
            None,
            jnp.zeros((1, 9, 16, heads, 64), dtype),
            jnp.int32(0),
            jnp.zeros((2,), jnp.int32),
            jnp.zeros((2, 4), jnp.int32),
            jnp.zeros((3,), jnp.int32),
            jnp.zeros((1,), jnp.int32),
        )

    with pytest.raises(NotImplementedError, match="float16"):
        ragged_paged_attention_tpu_stacked.trace(*args(jnp.float16, 16), num_kv_heads=2).lower(
            lowering_platforms=("tpu",)
        )
    with pytest.raises(NotImplementedError, match="C=2 is not a multiple of 4"):
        ragged_paged_attention_tpu_stacked.trace(*args(jnp.float8_e4m3fn, 2), num_kv_heads=1).lower(
            lowering_platforms=("tpu",)
        )


# ---- the padded cache kv_cache_shape gives the TPU kernel: combined heads padded to the tile ----

PADDED_CASES = {
    "hkv1_g4": (
        dict(seqs=[(1, 9), (5, 11), (2, 2)], num_q_heads=4, num_kv_heads=1, head_dim=64, num_tokens=8),
        dict(sm_scale=0.125),
    ),
    "hkv3_g2": (
        dict(seqs=cases.MIXED, num_q_heads=6, num_kv_heads=3, head_dim=64, num_tokens=16),
        dict(sm_scale=0.125, soft_cap=5.0),
    ),
}


def pad_heads(kv_pages, heads, fill=0.0):
    """[..., 2*Hkv, D] -> [..., heads, D]: the real combined heads, then ``fill`` padding heads."""
    pad = [(0, 0)] * (kv_pages.ndim - 2) + [(0, heads - kv_pages.shape[-2]), (0, 0)]
    return jnp.pad(kv_pages, pad, constant_values=fill)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name,heads,fill",
    [
        ("hkv1_g4", 16, 0.0),  # bf16's tile (16) with f32 data: CPU has no native bf16
        ("hkv3_g2", None, 0.0),  # the f32 rule: 6 -> 8
        ("hkv3_g2", 16, float("nan")),  # NaN padding: the output proves padding is never read
    ],
)
def test_kernel_on_padded_cache(name, heads, fill):
    """Padded cache == reference and jax's oracle on the unpadded cache; the padding heads of the
    rows this step writes become zero (a whole tile-aligned row per token), every other padding
    head keeps its value."""
    case_args, kwargs = PADDED_CASES[name]
    case = cases.make_case(0, **case_args, **cases.SHAPES)
    hkv = case_args["num_kv_heads"]
    if heads is None:
        spec = KVCacheSpec(1, *case.kv_pages.shape[:2], hkv, case.kv_pages.shape[-1], jnp.float32)
        heads = kv_cache_shape("pallas_tpu", spec)[3]
        assert heads == 8
    out, kv = ragged_paged_attention_tpu(
        case.queries,
        case.new_kv,
        pad_heads(case.kv_pages, heads, fill),
        *case.metadata,
        interpret=RACES,
        num_queries_per_block=4,
        num_kv_pages_per_block=2,
        **kwargs,
    )
    jax.block_until_ready((out, kv))
    assert not races_found(), "the race detector reported a data race"
    assert kv.shape[-2] == heads
    want, want_kv = cases.expected(case, **kwargs)
    np.testing.assert_array_equal(cases.f32(kv[..., : 2 * hkv, :]), cases.f32(want_kv))
    written = np.any(cases.f32(want_kv) != cases.f32(case.kv_pages), axis=(-2, -1))  # [P, ps]
    assert written.sum() == case.num_real_tokens  # one row per real token
    pad = np.where(written[..., None, None], 0.0, fill)
    np.testing.assert_array_equal(
        cases.f32(kv[..., 2 * hkv :, :]), np.broadcast_to(pad, kv[..., 2 * hkv :, :].shape)
    )
    np.testing.assert_allclose(cases.f32(out), cases.f32(want), **cases.tolerance(jnp.float32))
    n = case.num_real_tokens
    np.testing.assert_allclose(
        cases.f32(out[:n]), cases.f32(cases.oracle(case, want_kv, **kwargs)), **cases.tolerance(jnp.float32)
    )


@pytest.mark.timeout(300)
def test_attend_without_writing_on_padded_cache():
    """new_kv=None: num_kv_heads says where the real heads end (C alone cannot)."""
    case_args, kwargs = PADDED_CASES["hkv1_g4"]
    case = cases.make_case(1, **case_args, **cases.SHAPES)
    out, kv = ragged_paged_attention_tpu(
        case.queries,
        None,
        pad_heads(case.kv_pages, 16),
        *case.metadata,
        interpret=RACES,
        num_queries_per_block=8,
        num_kv_pages_per_block=3,
        num_kv_heads=1,
        **kwargs,
    )
    jax.block_until_ready((out, kv))
    assert not races_found()
    np.testing.assert_array_equal(cases.f32(kv), cases.f32(pad_heads(case.kv_pages, 16)))
    want = cases.ragged_paged_attention_ref(case.queries, case.kv_pages, *case.metadata, **kwargs)
    np.testing.assert_allclose(cases.f32(out), cases.f32(want), **cases.tolerance(jnp.float32))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("head_dim", [64, 32], ids=["lane-packed", "padded"])
def test_dispatch_on_allocated_padded_cache(head_dim):
    """The engine's path: KVCacheSpec.allocate('pallas_tpu_interpret'), two jitted layers through
    dispatch == 'reference' on the unpadded allocation. head_dim 64: the lane-packed layout (one
    row of K | V per head, 1 -> 8 rows); 32: the padded one (f32: 2 -> 8 combined heads)."""
    case_args, kwargs = PADDED_CASES["hkv1_g4"]
    case = cases.make_case(2, **{**case_args, "head_dim": head_dim}, **cases.SHAPES)
    spec = KVCacheSpec(2, *case.kv_pages.shape[:2], 1, case.kv_pages.shape[-1], jnp.float32)
    new_k, new_v = split_kv(case.new_kv)
    md = AttentionMetadata(*case.metadata)
    params = AttentionParams(**kwargs)

    def step(impl):
        def layer(c, i):
            scale = (i + 1).astype(new_k.dtype)  # each layer its own K/V: a wrong layer shows
            out, c = ragged_paged_attention(
                case.queries, new_k * scale, new_v * scale, c, i, md, params, impl
            )
            return c, out

        run = jax.jit(lambda c: jax.lax.scan(layer, c, jnp.arange(2, dtype=jnp.int32)))
        return run(spec.allocate(impl))

    got, out = step("pallas_tpu_interpret")
    want, want_out = step("reference")
    packed = head_dim == 64
    assert got.shape == (2, *case.kv_pages.shape[:2], 8, (2 if packed else 1) * head_dim)
    if packed:
        from tpuserve.attention.pallas_tpu import unpack_kv_lanes

        np.testing.assert_array_equal(cases.f32(unpack_kv_lanes(got, 1)), cases.f32(want))
        assert not cases.f32(got[..., 1:, :]).any()
    else:
        np.testing.assert_array_equal(cases.f32(got[..., :2, :]), cases.f32(want))
        assert not cases.f32(got[..., 2:, :]).any()
    np.testing.assert_allclose(cases.f32(out), cases.f32(want_out), atol=1e-4, rtol=1e-4)


def test_dispatch_rejects_padded_cache_for_unpadded_impls():
    """reference / blocked / pallas_gpu read C as 2*Hkv: a padded cache is an error, not garbage."""
    case, kwargs, _ = cases.build("decode_g8")
    new_k, new_v = split_kv(case.new_kv)
    with pytest.raises(ValueError, match="combined-head axis"):
        ragged_paged_attention(
            case.queries,
            new_k,
            new_v,
            pad_heads(case.kv_pages, 8)[None],
            jnp.int32(0),
            AttentionMetadata(*case.metadata),
            AttentionParams(**kwargs),
            "reference",
        )


@pytest.mark.timeout(240)
def test_lowers_to_mosaic_padded_cache():
    """Two KV heads in bf16 on the padded cache (4 -> 16 combined heads) lower to Mosaic."""
    slots, hq, hkv, d, layers, pages, ps, pps, tokens = 8, 8, 2, 128, 2, 65, 16, 8, 32
    spec = KVCacheSpec(layers, pages, ps, hkv, d, jnp.bfloat16)
    args = (
        jax.ShapeDtypeStruct((tokens, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens, 2 * hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct(kv_cache_shape("pallas_tpu", spec), jnp.bfloat16),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots, pps), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    assert args[2].shape[3] == 16
    lowered = ragged_paged_attention_tpu_stacked.trace(*args, sm_scale=0.08).lower(
        lowering_platforms=("tpu",)
    )
    assert "tpu_custom_call" in lowered.as_text()


# ---- the lane-packed layout (head_dim 64 models on a TPU): a head's K | V in one 128-lane row ----


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name,block",
    [
        ("decode_g8", dict(num_queries_per_block=1, num_kv_pages_per_block=2)),
        ("window_g8", dict(num_queries_per_block=4, num_kv_pages_per_block=1)),
        ("soft_cap_g1", dict(num_queries_per_block=3, num_kv_pages_per_block=3)),
        pytest.param(
            "mixed_g3_d128",  # 2 KV heads: rows padded 2 -> 8
            dict(num_queries_per_block=1, num_kv_pages_per_block=6, single_item_decode=True),
            id="mixed_g3_d128-one-item",
        ),
    ],
)
def test_lane_packed_cache_matches_reference_and_oracle(name, block):
    """The kernel on ``pack_kv_lanes``' layout == the jnp reference and jax's oracle on the
    interleaved cache; the written cache, unpacked, == ``write_kv_ref`` exactly, and padding rows
    stay zero."""
    from tpuserve.attention.pallas_tpu import pack_kv_lanes, unpack_kv_lanes

    case, kwargs, dtype = cases.build(name)
    hkv = case.new_kv.shape[1] // 2
    packed = pack_kv_lanes(case.kv_pages, hkv)
    assert packed.shape[-2:] == (8, 2 * case.kv_pages.shape[-1])
    np.testing.assert_array_equal(cases.f32(unpack_kv_lanes(packed, hkv)), cases.f32(case.kv_pages))
    out, kv = ragged_paged_attention_tpu(
        case.queries, case.new_kv, packed, *case.metadata, interpret=RACES, **block, **kwargs
    )
    jax.block_until_ready((out, kv))
    assert not races_found(), "the race detector reported a data race"
    cases.check_step(case, kwargs, dtype, out, unpack_kv_lanes(kv, hkv))
    assert not cases.f32(kv[..., hkv:, :]).any()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "num_tokens,cache_dtype",
    [(32, jnp.bfloat16), (64, jnp.bfloat16), (32, jnp.uint8)],
    ids=["decode", "mixed", "decode-fp8"],
)
def test_lane_packed_cache_lowers_to_mosaic(num_tokens, cache_dtype):
    """The lane-packed kernel (uint32 word loads of two bf16 heads' [K | V] rows, or four FP8
    heads' codes) lowers for TPU at the 1B shape (32 q / 8 KV heads, head_dim 64: an [8, 128] page
    row a token)."""
    slots, hq, hkv, d = 32, 32, 8, 64
    fp8 = cache_dtype == jnp.uint8
    args = (
        jax.ShapeDtypeStruct((num_tokens, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_tokens, 2 * hkv, d), jnp.float8_e4m3fn if fp8 else jnp.bfloat16),
        jax.ShapeDtypeStruct((2, 1025, 16, 8, 2 * d), cache_dtype),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots, 64), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    text = _lowered_for_tpu(args, **(dict(kv_dtype=jnp.float8_e4m3fn) if fp8 else {}))
    assert "tpu_custom_call" in text


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name,chunk_rows,items",
    [
        ("decode_g8", 64, 1),  # 8-token chunks of a 24-token block: 1-3 walked, the last one cut
        ("decode_g8", 64, 3),  # 3 tokens a step: items of 1-3 chunks together, 2 padding items
        ("decode_g8", None, None),  # the generation's chunk (the whole block) and items
        ("window_g8", 64, 2),  # the walk starts at the window's chunk; a 6-token chunk sees earlier rows
        ("soft_cap_g1", 32, 4),  # f32, 2 KV heads, G = 1: chunks of 4 tokens
        pytest.param("mixed_g3_d128", 64, 4, id="mixed_g3_d128-64"),  # G = 3, 2 of 8 rows real
        pytest.param("bf16_g3_d128", 64, 5, id="bf16_g3_d128-64", marks=pytest.mark.slow),
    ],
)
def test_fused_head_decode_matches_reference_and_oracle(name, chunk_rows, items):
    """The one-item path with every KV head in one matmul pair (``fused_heads``) on the
    lane-packed cache == the jnp reference and jax's oracle, for decodes and for the other tokens
    of mixed batches (a prompt's earlier tokens see fewer chunks than kv_len holds), one or several
    tokens a grid step."""
    from tpuserve.attention.pallas_tpu import pack_kv_lanes, unpack_kv_lanes

    case, kwargs, dtype = cases.build(name)
    hkv = case.new_kv.shape[1] // 2
    packed = pack_kv_lanes(case.kv_pages, hkv)
    out, kv = ragged_paged_attention_tpu(
        case.queries,
        case.new_kv,
        packed,
        *case.metadata,
        interpret=RACES,
        num_queries_per_block=1,
        num_kv_pages_per_block=cases.SHAPES["pages_per_seq"],
        single_item_decode=True,
        fused_heads=True,
        fused_chunk_rows=chunk_rows,
        fused_items=items,
        **kwargs,
    )
    jax.block_until_ready((out, kv))
    assert not races_found(), "the race detector reported a data race"
    cases.check_step(case, kwargs, dtype, out, unpack_kv_lanes(kv, hkv))


@pytest.mark.parametrize(
    "kv_block,heads,rows,want",
    [
        (256, 8, 1024, 128),
        (192, 8, 1024, 96),
        (24, 8, 64, 8),
        (24, 8, 1024, 24),
        (16, 16, 1024, 16),
        (6, 8, 8, 6),
    ],
)
def test_fused_chunk_divides_the_block_in_whole_tiles(kv_block, heads, rows, want):
    from tpuserve.attention.pallas_tpu import _chunk_tokens

    got = _chunk_tokens(kv_block, heads, rows)
    assert got == want and kv_block % got == 0 and (got * heads) % 16 == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fused", [False, True])
def test_fused_head_decode_lowers_to_mosaic(fused):
    """The fused one-item path lowers for TPU at the 1B shape (an [8, 128] lane-packed row a
    token), named ``_fused<chunk tokens>``; unset it follows the generation (off on CPU's entry)."""
    slots, hq, hkv, d = 32, 32, 8, 64
    args = (
        jax.ShapeDtypeStruct((slots, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((slots, 2 * hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, 1025, 16, 8, 2 * d), jnp.bfloat16),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots, 16), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    text = _lowered_for_tpu(args, single_item_decode=True, fused_heads=True if fused else None)
    assert "tpu_custom_call" in text
    assert ("_fused128x4" in text) == fused


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pages_per_seq,fused", [(16, True), (64, False)])
def test_fused_head_decode_unset_takes_short_buckets_only(monkeypatch, pages_per_seq, fused):
    """``fused_heads=None`` (what the engine passes) takes the fused path where the generation
    turns it on and the page-table bucket holds at most ``fused_max_kv_tokens`` tokens (256 here:
    16 pages of 16), and the per-head loop for longer buckets, where the fused path's C-fold score
    work cost more on a v5e."""
    from tpuserve.attention import pallas_tpu

    monkeypatch.setattr(
        pallas_tpu,
        "_FALLBACK_BLOCK_SIZES",
        dataclasses.replace(
            pallas_tpu._FALLBACK_BLOCK_SIZES,
            single_item_decode=True,
            decode_kv_tokens_per_block=1024,
            fused_head_decode=True,
            fused_max_kv_tokens=256,
        ),
    )
    slots, hq, hkv, d = 32, 32, 8, 64
    args = (
        jax.ShapeDtypeStruct((slots, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((slots, 2 * hkv, d), jnp.bfloat16),
        # a page count per case: the jitted kernel reads the defaults at trace time
        jax.ShapeDtypeStruct((2, 1030 + pages_per_seq, 16, 8, 2 * d), jnp.bfloat16),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    text = _lowered_for_tpu(args)
    assert "_one_item" in text
    assert ("_fused" in text) == fused

"""The Pallas TPU kernel on a 1-byte FP8 KV cache, in TPU interpret mode (race detection on).

The cache is what the engine allocates for ``pallas_tpu`` (``kv_cache_shape``: C padded to 32 for
8-bit), holding float8 codes as uint8 bytes (``kv_storage_dtype``) unless a case says otherwise;
this step's K/V arrive quantized, as ``quantize_kv`` hands them over. Each case checks:

* the written cache, byte for byte, == ``write_kv_ref`` of the same codes on the unpadded cache,
  and the padding heads of the written rows are zero;
* the output == the jnp reference reading the same bytes (``kv_dtype``, the scales) and == jax's
  own ``ref_ragged_paged_attention`` on the dequantized f32 cache (f32 tolerance: the decode is
  exact, only summation order differs).

Interpret mode builds the 32-bit words the compiled kernel loads from byte rows
(``_packed_byte_rows``), so the shifts and the integer decode run here; the chip's own packing of
8-bit rows is exercised by ``benchmarks/attention_tpu.py --kv-dtype fp8``. ``test_exports_for_tpu``
lowers the compiled form at the Llama-3.2-1B shape, so a lowering failure shows in CI.
"""

from __future__ import annotations

import attention_cases as cases  # tests/attention/attention_cases.py
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from pallas_interpret import RACES, fresh_interpreter, races_found  # noqa: F401 (autouse fixture)

from tpuserve.attention.dispatch import kv_cache_shape
from tpuserve.attention.kv_cache_shape import combined_heads, kv_storage_dtype
from tpuserve.attention.pallas_tpu import (
    _fp8_to_f32,
    check_compiled_cache_dtype,
    fp8_value_dtype,
    ragged_paged_attention_tpu,
    ragged_paged_attention_tpu_stacked,
)
from tpuserve.attention.reference import ragged_paged_attention_ref, write_kv_ref
from tpuserve.kv_cache.layout import KVCacheSpec

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

# name: (make_case arguments, attention kwargs, (bq, kv pages per block), fp8 dtype, storage)
# storage "bytes": uint8 (the engine's), "fp8": the float8 type itself.
FP8_CASES = {
    # decodes only (bq = 1: the decode path), G = 4, two KV heads share one 32-bit word
    "decode_g4_d64": (
        dict(
            seqs=[(1, 1), (1, 8), (1, 13), (1, 24)], num_q_heads=8, num_kv_heads=2, head_dim=64, num_tokens=6
        ),
        dict(sm_scale=0.125, k_scale=0.02, v_scale=0.05),
        (1, 2),
        E4M3,
        "bytes",
    ),
    # prefill chunks, head_dim 128, G = 2
    "prefill_g2_d128": (
        dict(seqs=[(7, 7), (4, 4), (12, 12)], num_q_heads=4, num_kv_heads=2, head_dim=128, num_tokens=24),
        dict(sm_scale=0.09, k_scale=0.3, v_scale=0.007),
        (8, 2),
        E4M3,
        "bytes",
    ),
    # decodes and chunks; 3 KV heads: head 2's word holds two padding bytes
    "mixed_g2_hkv3": (
        dict(seqs=cases.MIXED, num_q_heads=6, num_kv_heads=3, head_dim=64, num_tokens=16),
        dict(sm_scale=0.125, k_scale=0.05, v_scale=0.04, soft_cap=5.0),
        (3, 2),
        E4M3,
        "bytes",
    ),
    # 8 KV heads (Llama-3's count): C = 16 real heads fill half the 32-row tile
    "mixed_g2_hkv8": (
        dict(seqs=[(1, 9), (5, 11), (2, 2)], num_q_heads=16, num_kv_heads=8, head_dim=64, num_tokens=8),
        dict(sm_scale=0.125, k_scale=0.01, v_scale=0.03),
        (4, 2),
        E4M3,
        "bytes",
    ),
    # a sliding window that skips whole KV blocks, e5m2 codes
    "window_g8_e5m2": (
        dict(
            seqs=[(1, 21), (6, 17), (2, 2), (1, 5)], num_q_heads=8, num_kv_heads=1, head_dim=64, num_tokens=12
        ),
        dict(sm_scale=0.3, sliding_window=5, k_scale=0.5, v_scale=2.0),
        (4, 1),
        E5M2,
        "bytes",
    ),
    # the cache typed float8 itself (no kv_dtype)
    "mixed_g3_fp8_typed": (
        dict(seqs=cases.MIXED, num_q_heads=6, num_kv_heads=2, head_dim=128, num_tokens=16),
        dict(sm_scale=0.09, k_scale=0.04, v_scale=0.04),
        (4, 2),
        E4M3,
        "fp8",
    ),
}
SLOW = {"prefill_g2_d128", "mixed_g2_hkv8"}


def quantize(x, scale, dtype):
    """numpy: clip(x / scale) to the format's finite range, cast (round to nearest)."""
    limit = float(ml_dtypes.finfo(dtype).max)
    return np.clip(np.asarray(x, np.float32) / np.float32(scale), -limit, limit).astype(dtype)


def quantize_pages(kv, k_scale, v_scale, dtype):
    """[..., 2*Hkv, D] interleaved f32 -> the same as ``dtype`` codes (K / k_scale, V / v_scale)."""
    kv = np.asarray(kv, np.float32)
    out = np.empty(kv.shape, dtype)
    out[..., 0::2, :] = quantize(kv[..., 0::2, :], k_scale, dtype)
    out[..., 1::2, :] = quantize(kv[..., 1::2, :], v_scale, dtype)
    return out


def dequantize(codes, k_scale, v_scale):
    out = np.asarray(codes).astype(np.float32)
    out[..., 0::2, :] *= k_scale
    out[..., 1::2, :] *= v_scale
    return out


def fp8_step(name, seed=0):
    """(case with f32 data, kwargs, blocks, fp8 dtype, storage dtype, old codes, new codes)."""
    case_args, kwargs, blocks, dtype, storage = FP8_CASES[name]
    case = cases.make_case(seed, **case_args, **cases.SHAPES)
    old = quantize_pages(case.kv_pages, kwargs["k_scale"], kwargs["v_scale"], dtype)
    new = quantize_pages(case.new_kv, kwargs["k_scale"], kwargs["v_scale"], dtype)
    stored = np.dtype(np.uint8) if storage == "bytes" else np.dtype(dtype)
    return case, kwargs, blocks, dtype, stored, old, new


def padded_cache(old, num_kv_heads, stored):
    """Unpadded [P, ps, 2*Hkv, D] codes -> the kernel's padded [P, ps, C, D] cache in ``stored``
    dtype (the engine's layout for head_dim 128; head_dim 64 it lane-packs, tested below)."""
    shape = (*old.shape[:2], combined_heads("pallas_tpu", num_kv_heads, stored), old.shape[3])
    assert shape[2] % 32 == 0, shape  # the 8-bit tile
    out = np.zeros(shape, np.uint8)
    out[..., : old.shape[2], :] = old.view(np.uint8)
    return jnp.asarray(out.view(stored))


def as_bytes(x):
    return np.asarray(x).view(np.uint8)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in FP8_CASES]
)
def test_fp8_kernel_matches_reference_and_oracle(name):
    case, kwargs, (bq, ppb), dtype, stored, old, new = fp8_step(name)
    hkv = case.new_kv.shape[1] // 2
    cache = padded_cache(old, hkv, stored)
    out, kv = ragged_paged_attention_tpu(
        case.queries,
        jnp.asarray(new),
        cache,
        *case.metadata,
        kv_dtype=dtype if stored == np.uint8 else None,
        interpret=RACES,
        num_queries_per_block=bq,
        num_kv_pages_per_block=ppb,
        **kwargs,
    )
    jax.block_until_ready((out, kv))
    assert not races_found(), "the race detector reported a data race"
    assert kv.dtype == stored and kv.shape == cache.shape

    # The write: exactly write_kv_ref's bytes on the unpadded cache; padding stays zero.
    want_kv = write_kv_ref(jnp.asarray(old.view(np.uint8)), jnp.asarray(new), *case.metadata)
    np.testing.assert_array_equal(as_bytes(kv)[..., : 2 * hkv, :], as_bytes(want_kv))
    assert not as_bytes(kv)[..., 2 * hkv :, :].any(), "padding heads must stay zero"

    n = case.num_real_tokens
    ref = ragged_paged_attention_ref(case.queries, want_kv, *case.metadata, kv_dtype=dtype, **kwargs)
    np.testing.assert_allclose(cases.f32(out), cases.f32(ref), **cases.tolerance(jnp.float32))
    deq = dequantize(as_bytes(want_kv).view(dtype), kwargs["k_scale"], kwargs["v_scale"])
    plain = {k: v for k, v in kwargs.items() if k not in ("k_scale", "v_scale")}
    want = cases.oracle(case, jnp.asarray(deq), **plain)
    np.testing.assert_allclose(cases.f32(out[:n]), cases.f32(want), **cases.tolerance(jnp.float32))
    assert not cases.f32(out[n:]).any()  # padding tokens


@pytest.mark.timeout(400)
def test_fp8_kernel_with_sinks_and_bf16_queries():
    """gpt-oss's sinks on an FP8 cache, bf16 queries (the decoded K/V are cast to bf16 for the
    matmuls, exact for every fp8 value), against the reference reading the same bytes."""
    case, kwargs, _, dtype, _, old, new = fp8_step("mixed_g2_hkv3", seed=2)
    hkv = case.new_kv.shape[1] // 2
    sinks = jnp.asarray(np.random.default_rng(5).uniform(-1.0, 3.0, case.queries.shape[1]), jnp.float32)
    queries = case.queries.astype(jnp.bfloat16)
    out, kv = ragged_paged_attention_tpu(
        queries,
        jnp.asarray(new),
        padded_cache(old, hkv, np.dtype(np.uint8)),
        *case.metadata,
        kv_dtype=dtype,
        sinks=sinks,
        interpret=RACES,
        num_queries_per_block=4,
        num_kv_pages_per_block=2,
        **kwargs,
    )
    jax.block_until_ready((out, kv))
    assert not races_found()
    assert out.dtype == jnp.bfloat16
    written = jnp.asarray(as_bytes(kv)[..., : 2 * hkv, :])
    ref = ragged_paged_attention_ref(queries, written, *case.metadata, kv_dtype=dtype, sinks=sinks, **kwargs)
    np.testing.assert_allclose(cases.f32(out), cases.f32(ref), **cases.tolerance(jnp.bfloat16))
    # The sinks matter here: without them the output moves well past the tolerance.
    no_sinks = ragged_paged_attention_ref(queries, written, *case.metadata, kv_dtype=dtype, **kwargs)
    assert np.abs(cases.f32(no_sinks) - cases.f32(ref)).max() > 0.2


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_decode_is_exact_for_every_code(dtype):
    """The kernel's integer decode == ml_dtypes' cast for all 256 codes but NaN / inf (never
    stored: quantize_kv clips), signed zero and subnormals included."""
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(dtype).astype(np.float32)
    got = np.asarray(jax.jit(lambda c: _fp8_to_f32(c, dtype))(jnp.asarray(codes, jnp.int32)))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite], want[finite])
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))
    assert np.isfinite(got).all()


def test_cache_dtype_pairings():
    assert fp8_value_dtype(jnp.uint8, E4M3) == E4M3 and fp8_value_dtype(E5M2) == E5M2
    assert fp8_value_dtype(jnp.bfloat16) is None and fp8_value_dtype(jnp.float32) is None
    with pytest.raises(ValueError, match="bfloat16 KV cache cannot hold float8_e4m3fn"):
        fp8_value_dtype(jnp.bfloat16, E4M3)
    with pytest.raises(NotImplementedError, match="int8"):
        fp8_value_dtype(jnp.int8)
    with pytest.raises(NotImplementedError, match="C=6 is not a multiple of 4"):
        check_compiled_cache_dtype(jnp.uint8, 6)
    with pytest.raises(NotImplementedError, match="float16"):
        check_compiled_cache_dtype(jnp.float16, 16)
    check_compiled_cache_dtype(jnp.uint8, 32)
    # The engine stores FP8 as uint8 on CPU and TPU; the GPU kernel reads fp8 itself.
    assert kv_storage_dtype(E4M3, "tpu") == np.uint8 and kv_storage_dtype(E4M3, "cpu") == np.uint8
    assert kv_storage_dtype(E4M3, "gpu") == E4M3 and kv_storage_dtype(jnp.bfloat16, "tpu") == jnp.bfloat16


def llama_1b_shape():
    """(Hq, Hkv, head_dim) of the Llama-3.2-1B shape the TPU sessions serve."""
    import json
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", ".tpu_carry", "shapes", "llama-1b-gqa", "config.json")
    if os.path.exists(path):
        with open(path) as f:
            cfg = json.load(f)
        return cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    return 32, 8, 64


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "num_tokens,storage,options",
    [
        (32, "bytes", {}),  # tokens <= slots: the decode path
        (128, "bytes", dict(sliding_window=256, soft_cap=30.0)),
        (64, "fp8", {}),
    ],
    ids=["decode_uint8", "mixed_uint8_window_cap", "mixed_fp8_typed"],
)
def test_exports_for_tpu(num_tokens, storage, options):
    """``jax.export`` for platforms=["tpu"] of a jitted step over the FP8 kernel, the cache donated,
    at the Llama-3.2-1B shape (32 q / 8 KV heads, head_dim 64: the engine's lane-packed cache, 8
    rows of a head's K | V codes in 128 byte lanes) with the engine's
    default block sizes: the kernel lowers to a Mosaic custom call without a TPU, and the cache
    stays aliased to the output (updated in place). Mosaic's own passes run only on a chip."""
    hq, hkv, d = llama_1b_shape()
    slots, layers, pages, ps, pps = 32, 16, 1025, 16, 64
    stored = np.dtype(np.uint8) if storage == "bytes" else np.dtype(E4M3)
    spec = KVCacheSpec(layers, pages, ps, hkv, d, stored)
    shape = kv_cache_shape("pallas_tpu", spec)
    assert shape[3:] == (8, 2 * d)
    args = (
        jax.ShapeDtypeStruct((num_tokens, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_tokens, 2 * hkv, d), E4M3),
        jax.ShapeDtypeStruct(shape, stored),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots, pps), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    kv_dtype = E4M3 if storage == "bytes" else None

    def step(q, new_kv, cache, layer, *md):
        return ragged_paged_attention_tpu_stacked(
            q,
            new_kv,
            cache,
            layer,
            *md,
            sm_scale=0.125,
            k_scale=0.05,
            v_scale=0.02,
            kv_dtype=kv_dtype,
            **options,
        )

    exported = jax.export.export(jax.jit(step, donate_argnums=(2,)), platforms=["tpu"])(*args)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    cache_type = "tensor<" + "x".join(map(str, shape)) + ("xui8>" if storage == "bytes" else "xf8E4M3FN>")
    assert cache_type in main and "tf.aliasing_output" in main, main


def test_fp8_page_bytes_against_bf16():
    """What each layout costs (the memory plan's page_bytes). head_dim 128: with up to 8 KV heads a
    token of an fp8 cache takes as many bytes as bf16's (32 rows of 1 byte vs 16 of 2); 16 KV heads
    halve it. head_dim 64 (Llama-3.2-1B): both are lane-packed, their payload: 16 layers x 2,048 B
    = 32 KiB a token in bf16, half that in fp8."""
    hq, hkv, d = llama_1b_shape()

    def per_token(num_kv_heads, head_dim, dtype, layers=16):
        spec = KVCacheSpec(layers, 1, 16, num_kv_heads, head_dim, dtype)
        return spec.page_bytes("pallas_tpu") // 16, spec.bytes_per_page // 16

    assert per_token(hkv, d, jnp.bfloat16) == (16 * 2048, 16 * 2048)  # lane-packed: the payload
    assert per_token(hkv, d, jnp.uint8) == (16 * 1024, 16 * 1024)  # lane-packed: the payload
    assert per_token(8, 128, jnp.uint8)[0] == per_token(8, 128, jnp.bfloat16)[0]  # Llama-3-8B
    assert 2 * per_token(16, 128, jnp.uint8)[0] == per_token(16, 128, jnp.bfloat16)[0]


@pytest.mark.timeout(400)
def test_dispatch_fp8_bytes_in_layer_scan():
    """The engine's call: dispatch (quantize_kv, then the kernel) in a jitted lax.scan over a
    2-layer uint8 cache of e4m3 codes (params.kv_dtype), the layer index traced ==
    'reference' on the unpadded uint8 cache: the same bytes written in each layer, close outputs."""
    from tpuserve.attention.dispatch import AttentionParams, ragged_paged_attention, split_kv
    from tpuserve.attention.metadata import AttentionMetadata

    case, kwargs, _, dtype, _, old, _ = fp8_step("mixed_g2_hkv3", seed=3)
    hkv = case.new_kv.shape[1] // 2
    other = quantize_pages(
        np.random.default_rng(9).standard_normal(old.shape), kwargs["k_scale"], kwargs["v_scale"], dtype
    )
    plain = jnp.asarray(np.stack([other, old]).view(np.uint8))
    padded = jnp.stack(
        [padded_cache(other, hkv, np.dtype(np.uint8)), padded_cache(old, hkv, np.dtype(np.uint8))]
    )
    new_k, new_v = split_kv(case.new_kv)
    md = AttentionMetadata(*case.metadata)
    params = AttentionParams(**kwargs, kv_dtype=jnp.dtype(dtype).name)

    def step(impl, cache):
        def layer(c, i):
            scale = (i + 1).astype(new_k.dtype)  # each layer its own K/V: a wrong layer shows
            out, c = ragged_paged_attention(
                case.queries, new_k * scale, new_v * scale, c, i, md, params, impl
            )
            return c, out

        return jax.jit(lambda c: jax.lax.scan(layer, c, jnp.arange(2, dtype=jnp.int32)))(cache)

    got, out = step("pallas_tpu_interpret", padded)
    want, want_out = step("reference", plain)
    assert got.dtype == jnp.uint8 and got.shape[3] == 32
    np.testing.assert_array_equal(np.asarray(got)[..., : 2 * hkv, :], np.asarray(want))
    assert not np.asarray(got)[..., 2 * hkv :, :].any()
    np.testing.assert_allclose(cases.f32(out), cases.f32(want_out), atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["decode_g4_d64", "mixed_g2_hkv3"])
def test_fp8_lane_packed_cache_matches_reference(name):
    """The lane-packed FP8 cache (a head's K | V codes in one 128-lane byte row, four heads a
    32-bit word) == the reference reading the same bytes interleaved; the written bytes, unpacked,
    == the quantized step's K/V placed as ``write_kv_ref`` places them."""
    from tpuserve.attention.pallas_tpu import pack_kv_lanes, unpack_kv_lanes

    case, kwargs, (bq, ppb), dtype, stored, old, new = fp8_step(name)
    hkv = case.new_kv.shape[1] // 2
    cache = pack_kv_lanes(jnp.asarray(as_bytes(old)), hkv)
    assert cache.shape[-2:] == (8, 2 * old.shape[-1]) and cache.dtype == jnp.uint8
    out, kv = ragged_paged_attention_tpu(
        case.queries,
        jnp.asarray(new),
        cache,
        *case.metadata,
        kv_dtype=dtype,
        interpret=RACES,
        num_queries_per_block=bq,
        num_kv_pages_per_block=ppb,
        **kwargs,
    )
    jax.block_until_ready((out, kv))
    assert not races_found(), "the race detector reported a data race"
    want_kv = write_kv_ref(jnp.asarray(as_bytes(old)), jnp.asarray(as_bytes(new)), *case.metadata)
    written = unpack_kv_lanes(kv, hkv)
    np.testing.assert_array_equal(as_bytes(written), as_bytes(want_kv))
    assert not as_bytes(kv[..., hkv:, :]).any()
    ref = ragged_paged_attention_ref(case.queries, written, *case.metadata, kv_dtype=dtype, **kwargs)
    np.testing.assert_allclose(cases.f32(out), cases.f32(ref), **cases.tolerance(jnp.float32))

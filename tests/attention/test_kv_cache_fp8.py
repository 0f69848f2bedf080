"""An FP8 (float8_e4m3fn) KV cache with static k/v scales (``--kv-cache-dtype fp8``).

Attention level, per implementation, through ``dispatch.ragged_paged_attention`` (where the write
quantizes): the stored bytes are exactly ``clip(k / k_scale, +-448).astype(e4m3)``; the output
equals jax's ``ref_ragged_paged_attention`` on the dequantized cache (f32 tolerance) and is close
to the same implementation with an f32 cache (fp8 tolerance); K/V far beyond ``448 * scale``
saturate instead of turning into NaN. Engine level: greedy output on a tiny random-weight model
with an fp8 cache vs an f32 one, the page count for the same budget, and scales read from a
checkpoint that carries them.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil

import attention_cases as cases  # tests/attention/attention_cases.py
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from tpuserve.attention.dispatch import (
    AttentionParams,
    kv_cache_shape,
    quantize_kv,
    ragged_paged_attention,
    split_kv,
)
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.kv_cache.layout import KVCacheSpec
from tpuserve.tpu_platform.kv_scales import FP8_E4M3_MAX, scales_from_amax

FP8 = jnp.float8_e4m3fn
IMPLS = ["reference", "blocked", "pallas_tpu_interpret", "pallas_gpu"]


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    pltpu.reset_tpu_interpret_mode_state()
    yield
    pltpu.reset_tpu_interpret_mode_state()


def np_quantize(x, scale):
    """The oracle of a quantized write, in numpy: clip(x / scale) cast to e4m3 (round to nearest)."""
    y = np.clip(np.asarray(x, np.float32) / np.float32(scale), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.astype(ml_dtypes.float8_e4m3fn)


def np_quantize_pages(kv, k_scale, v_scale):
    """[..., 2*Hkv, D] interleaved pages -> the same in e4m3 (K rows / k_scale, V rows / v_scale)."""
    kv = np.asarray(kv, np.float32)
    out = np.empty(kv.shape, ml_dtypes.float8_e4m3fn)
    out[..., 0::2, :] = np_quantize(kv[..., 0::2, :], k_scale)
    out[..., 1::2, :] = np_quantize(kv[..., 1::2, :], v_scale)
    return out


def bits(x):
    return np.asarray(x).view(np.uint8)


def padded(pages, impl, num_kv_heads, dtype):
    """[P, ps, 2*Hkv, D] -> impl's [1, P, ps, C, D] layer-stacked cache (padding heads zero; the
    TPU kernel's head_dim-64 cache lane-packed, row h = [K_h | V_h])."""
    spec = KVCacheSpec(1, pages.shape[0], pages.shape[1], num_kv_heads, pages.shape[3], dtype)
    shape = kv_cache_shape(impl, spec)
    if shape[-1] == 2 * pages.shape[3]:
        from tpuserve.attention.pallas_tpu import pack_kv_lanes

        return pack_kv_lanes(jnp.asarray(pages), num_kv_heads, shape[-2])[None]
    out = np.zeros(shape, np.asarray(pages).dtype)
    out[0, ..., : pages.shape[2], :] = np.asarray(pages)
    return jnp.asarray(out)


def run(case, impl, cache, params):
    new_k, new_v = split_kv(case.new_kv)
    md = AttentionMetadata(*case.metadata)
    fn = jax.jit(lambda q, k, v, c, md: ragged_paged_attention(q, k, v, c, jnp.int32(0), md, params, impl))
    if impl != "pallas_gpu":
        return fn(case.queries, new_k, new_v, cache, md)
    # On a CPU-only machine the GPU kernel runs in interpret mode (as test_pallas_gpu.py does).
    import tpuserve.attention.dispatch as dispatch
    from tpuserve.attention.pallas_gpu import ragged_paged_attention_gpu_stacked

    original = dispatch.ragged_paged_attention_gpu_stacked
    dispatch.ragged_paged_attention_gpu_stacked = functools.partial(
        ragged_paged_attention_gpu_stacked, interpret=True
    )
    try:
        return fn(case.queries, new_k, new_v, cache, md)
    finally:
        dispatch.ragged_paged_attention_gpu_stacked = original


def fp8_case(name="mixed_g3_d128", seed=3):
    case, kwargs, _ = cases.build(name, seed=seed)
    # Scales from the data's own amax (margin 1.25, as calibration would pick them).
    kv = np.concatenate(
        [
            np.asarray(case.new_kv).reshape(-1, *case.new_kv.shape[1:]),
            np.asarray(case.kv_pages).reshape(-1, *case.kv_pages.shape[2:]),
        ]
    )
    k_scale, v_scale = scales_from_amax(np.abs(kv[:, 0::2]).max(), np.abs(kv[:, 1::2]).max())
    return case, kwargs, k_scale, v_scale


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "impl, stored",
    [(impl, "fp8") for impl in IMPLS]
    + [("reference", "bytes"), ("blocked", "bytes"), ("pallas_tpu_interpret", "bytes")],
)
def test_fp8_cache_matches_f32_cache_and_oracle(impl, stored):
    """stored="bytes": the cache holds the fp8 values' bytes as uint8, as the engine stores an FP8
    cache on CPU and TPU (kv_cache_shape.kv_storage_dtype); the jnp paths and the TPU kernel read
    and write those."""
    case, kwargs, k_scale, v_scale = fp8_case()
    hkv = case.new_kv.shape[1] // 2
    old8 = np_quantize_pages(case.kv_pages, k_scale, v_scale)  # the pages earlier steps wrote
    cache8 = padded(old8, impl, hkv, FP8)
    p8 = AttentionParams(**kwargs, k_scale=k_scale, v_scale=v_scale)
    if stored == "bytes":
        cache8 = jnp.asarray(bits(cache8))
        p8 = AttentionParams(**kwargs, k_scale=k_scale, v_scale=v_scale, kv_dtype="float8_e4m3fn")
    out8, got8 = run(case, impl, cache8, p8)
    out32, _ = run(case, impl, padded(case.kv_pages, impl, hkv, jnp.float32), AttentionParams(**kwargs))
    assert got8.dtype == cache8.dtype and got8.shape == cache8.shape

    # The write, bit for bit: this step's K/V quantized, scattered like write_kv_ref does.
    from tpuserve.attention.reference import write_kv_ref

    new8 = jnp.asarray(np_quantize_pages(case.new_kv, k_scale, v_scale))
    want8 = write_kv_ref(jnp.asarray(old8), new8, *case.metadata)
    np.testing.assert_array_equal(bits(got8[0, ..., : 2 * hkv, :]), bits(want8))
    assert not bits(got8[0, ..., 2 * hkv :, :]).any(), "padding heads must stay zero"

    # Exactly the attention of the dequantized cache (jax's own oracle, no scales).
    deq = np.asarray(want8, np.float32)
    deq[..., 0::2, :] *= k_scale
    deq[..., 1::2, :] *= v_scale
    n = case.num_real_tokens
    want = cases.oracle(case, jnp.asarray(deq), **kwargs)
    np.testing.assert_allclose(cases.f32(out8[:n]), cases.f32(want), atol=2e-4, rtol=2e-4)

    # Close to the f32 cache: e4m3 keeps 3 mantissa bits (relative step 1/8 at worst, 1/16 rms).
    err = np.abs(cases.f32(out8[:n]) - cases.f32(out32[:n]))
    scale = np.abs(cases.f32(out32[:n])).mean()
    assert err.max() < 0.25 * max(scale, 1.0), (err.max(), scale)
    assert err.mean() < 0.03 * max(scale, 1.0), (err.mean(), scale)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", ["reference", "pallas_tpu_interpret"])
def test_overflow_saturates_never_nan(impl):
    """K/V far beyond 448 * scale are stored as +-448 (jax's plain cast would give NaN)."""
    case, kwargs, _ = cases.build("decode_g8", seed=4)
    k_scale, v_scale = 0.01, 0.02
    big = np.asarray(case.new_kv, np.float32) * 1e4  # |x| up to ~4e4 >> 448 * 0.01
    case.new_kv = jnp.asarray(big)
    hkv = case.new_kv.shape[1] // 2
    cache = padded(np_quantize_pages(case.kv_pages, k_scale, v_scale), impl, hkv, FP8)
    out, got = run(case, impl, cache, AttentionParams(**kwargs, k_scale=k_scale, v_scale=v_scale))
    stored = np.asarray(got, np.float32)
    assert np.isfinite(stored).all()
    assert np.isfinite(cases.f32(out)).all()
    assert np.abs(stored).max() == FP8_E4M3_MAX
    # The jax behaviour the clip exists for (if this ever saturates by itself, the clip is free).
    assert np.isnan(np.asarray(jnp.asarray([1e4], jnp.float32).astype(FP8), np.float32)).all()


@pytest.mark.parametrize("impl", ["pallas_gpu"])
def test_gpu_kernel_refuses_a_cache_of_fp8_bytes(impl):
    """The GPU kernel would read a uint8 cache's bytes as numbers, so it refuses (a GPU stores an
    FP8 cache as fp8); the jnp paths and the TPU kernel read the fp8 values the bytes hold."""
    case, kwargs, k_scale, v_scale = fp8_case("decode_g8", seed=4)
    hkv = case.new_kv.shape[1] // 2
    cache = jnp.asarray(bits(padded(np_quantize_pages(case.kv_pages, k_scale, v_scale), impl, hkv, FP8)))
    p8 = AttentionParams(**kwargs, k_scale=k_scale, v_scale=v_scale, kv_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match=f"{impl}.*reads a KV cache in its own dtype"):
        run(case, impl, cache, p8)
    with pytest.raises(ValueError, match="uint8 KV cache cannot hold bfloat16"):
        run(case, "reference", cache, AttentionParams(**kwargs, kv_dtype="bfloat16"))


def test_quantize_kv_only_touches_scaled_or_fp8():
    """Without scales and with a model-dtype cache the write is the plain interleave (no f32
    round trip); with a bf16 model the fp8 write divides in f32 before one rounding."""
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.bfloat16)
    plain = quantize_kv(k, v, AttentionParams(sm_scale=1.0), jnp.bfloat16)
    np.testing.assert_array_equal(cases.f32(plain[:, 0::2]), cases.f32(k))
    q = quantize_kv(k, v, AttentionParams(sm_scale=1.0, k_scale=0.3, v_scale=0.07), FP8)
    np.testing.assert_array_equal(bits(q[:, 0::2]), bits(np_quantize(cases.f32(k), 0.3)))
    np.testing.assert_array_equal(bits(q[:, 1::2]), bits(np_quantize(cases.f32(v), 0.07)))


# ---- engine level ----

ENGINE = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, attention_impl="blocked")
PAGE_BYTES_F32 = 2 * 16 * 4 * 16 * 4  # L * page_size * 2*Hkv * D * 4 bytes (tiny llama, f32)


def _prompts():
    rng = np.random.default_rng(1)
    return [
        {"prompt_token_ids": [int(t) for t in rng.integers(100, 3000, n)]} for n in (5, 17, 33, 60, 9, 24)
    ]


def _greedy(llm, max_tokens=8, logprobs=0, prompt_logprobs=None):
    from tpuserve.server.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    return llm.generate(_prompts(), params)


def _prompt_logprobs(out):
    return np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])


@pytest.mark.timeout(600)
def test_engine_fp8_kv_greedy_and_pages(random_checkpoints):
    from tpuserve.server.llm import LLM

    path = random_checkpoints["llama"]
    budget = 30 * PAGE_BYTES_F32  # fp8: 120 pages, under the 8 x 16 + 1 cap
    ref = LLM(path, kv_cache_memory_bytes=budget, **ENGINE, warmup=False)
    want = _greedy(ref, logprobs=20, prompt_logprobs=0)
    ref_pages = ref.engine.runner.kv_spec.num_pages
    del ref
    llm = LLM(path, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8", **ENGINE, warmup=False)
    runner = llm.engine.runner
    # Stored as the fp8 values' bytes on CPU (XLA:CPU copies a whole fp8 cache around each access).
    assert runner.kv_cache_dtype == FP8 and runner.kv_cache.dtype == jnp.uint8
    assert ref_pages == 30 and runner.kv_spec.num_pages == 4 * ref_pages
    k_scale, v_scale = runner.kv_scales  # calibrated: the checkpoint carries none
    assert 0 < k_scale < 1 and 0 < v_scale < 1
    got = _greedy(llm, prompt_logprobs=0)

    # Teacher-forced: every prompt token's logprob (prefill chunks read earlier chunks back from
    # the fp8 cache) stays close to the f32 cache's. Wrong scales move them by whole units.
    diffs = np.concatenate([np.abs(_prompt_logprobs(g) - _prompt_logprobs(w)) for g, w in zip(got, want)])
    assert diffs.max() < 0.25 and diffs.mean() < 0.06, (diffs.max(), diffs.mean())

    # Greedy: a tiny random-weight model's logits are nearly flat (top-2 gaps of a few 0.01 over
    # a 128k vocab), so fp8 rounding may flip a near tie and the sequence then diverges. Where
    # a sequence first diverges, the fp8 pick must be a near tie under the f32 cache.
    agree = 0
    for g, w in zip(got, want):
        g_ids, w_out = list(g.outputs[0].token_ids), w.outputs[0]
        i = next((j for j, (a, b) in enumerate(zip(g_ids, w_out.token_ids)) if a != b), None)
        if i is None:
            agree += 1
            continue
        top = w_out.logprobs[i]
        assert g_ids[i] in top, (i, g_ids[i], top)
        gap = top[w_out.token_ids[i]].logprob - top[g_ids[i]].logprob
        assert gap < 0.25, (i, gap)
    assert agree >= 1


@pytest.mark.timeout(600)
def test_engine_reads_checkpoint_kv_scales(random_checkpoints, tmp_path):
    """Per-layer ``self_attn.k_scale`` / ``v_scale`` scalars (compressed-tensors naming) are used,
    max over layers, instead of calibrating."""
    from safetensors.numpy import save_file

    from tpuserve.server.llm import LLM
    from tpuserve.tpu_platform.models.arch import ModelConfigError

    src = random_checkpoints["llama"]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    scales = {
        "model.layers.0.self_attn.k_scale": np.float32(0.02),
        "model.layers.1.self_attn.k_scale": np.float32(0.05),
        "model.layers.0.self_attn.v_scale": np.float32(0.004),
        "model.layers.1.self_attn.v_scale": np.float32(0.003),
    }
    save_file({k: np.asarray(v).reshape(()) for k, v in scales.items()}, str(dst / "kv_scales.safetensors"))
    assert len(glob.glob(os.path.join(dst, "*.safetensors"))) >= 2
    llm = LLM(str(dst), kv_cache_dtype="fp8", num_gpu_blocks=40, **ENGINE, warmup=False)
    assert llm.engine.runner.kv_scales == pytest.approx((0.05, 0.004))
    assert llm.engine.worker.kv_scales == llm.engine.runner.kv_scales
    out = _greedy(llm)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    del llm

    # Only some layers carrying them is an error for an FP8 cache, not a silent mix; a
    # model-dtype cache does not read them.
    save_file(
        {
            "model.layers.0.self_attn.k_scale": np.asarray(0.02, np.float32),
            "model.layers.0.self_attn.v_scale": np.asarray(0.02, np.float32),
        },
        str(dst / "kv_scales.safetensors"),
    )
    with pytest.raises(ModelConfigError, match="kv_cache_dtype='fp8'.*some layers only"):
        LLM(str(dst), kv_cache_dtype="fp8", num_gpu_blocks=40, **ENGINE, warmup=False)
    llm = LLM(str(dst), num_gpu_blocks=40, **ENGINE, warmup=False)
    assert llm.engine.runner.kv_scales is None and llm.engine.runner.kv_cache.dtype == jnp.float32


def test_checkpoint_scale_names_and_calibration_formula():
    """ModelOpt (``k_proj.k_scale``) and older compressed-tensors (``k_proj.output_scale``) names
    are read too; bad scales are refused; ``scales_from_amax`` maps amax * 1.25 to 448."""
    from tpuserve.tpu_platform.kv_scales import MARGIN, scales_from_checkpoint

    modelopt = {
        "model.layers.0.self_attn.k_proj.k_scale": np.float32(0.1),
        "model.layers.0.self_attn.v_proj.v_scale": np.float32(0.2),
        "model.layers.1.self_attn.k_proj.output_scale": np.full(4, 0.3, np.float32),
        "model.layers.1.self_attn.v_proj.output_scale": np.float32(0.05),
    }
    assert scales_from_checkpoint(modelopt.get, 2) == pytest.approx((0.3, 0.2))
    assert scales_from_checkpoint({}.get, 2) is None
    with pytest.raises(ValueError, match="positive"):
        scales_from_checkpoint(
            {
                **modelopt,
                "model.layers.1.self_attn.v_proj.output_scale": np.float32(0.0),
                "model.layers.0.self_attn.v_proj.v_scale": np.float32(-1.0),
            }.get,
            2,
        )
    k, v = scales_from_amax(448.0, 44.8)
    assert MARGIN == 1.25 and (k, v) == pytest.approx((1.25, 0.125))

"""Attention sinks (gpt-oss: a learned per-query-head logit in the softmax denominator, no value) in
every attention implementation, against two oracles we did not write:

* transformers' gpt-oss eager attention (``eager_attention_forward`` in modeling_gpt_oss.py, which
  concatenates the sinks to the attention logits), run in float64 on dense per-sequence tensors
  built from the same queries and the written cache;
* jax's ``ref_ragged_paged_attention`` (no sinks) against sinks of -inf, which must change nothing.

Each impl runs on ragged steps of decodes and prefill chunks with GQA, with and without a sliding
window (and a soft cap, which applies to the scores, not the sink). The sinks are chosen so that
ignoring them moves the output far beyond the tolerance (checked in ``check``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import types

import attention_cases as cases  # tests/attention/attention_cases.py
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_interpret import RACES, fresh_interpreter, races_found  # noqa: F401 (autouse fixture)

from tpuserve.attention.blocked import common_prefix_pages, ragged_paged_attention_blocked
from tpuserve.attention.dispatch import AttentionParams, ragged_paged_attention, split_kv
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.attention.pallas_gpu import ragged_paged_attention_gpu
from tpuserve.attention.pallas_tpu import ragged_paged_attention_tpu, ragged_paged_attention_tpu_stacked
from tpuserve.attention.reference import ragged_paged_attention_ref, write_kv_ref

HERE = os.path.dirname(os.path.abspath(__file__))

# name: (shared case, extra attention options). mixed: decodes and chunks, G = 3; window: decodes
# and a chunk under a 5-token window, G = 8; capped: the same with a soft cap below the largest sinks.
SINK_CASES = {
    "mixed_g3": ("mixed_g3_d128", {}),
    "window_g8": ("window_g8", {}),
    "window_cap_g8": ("window_g8", dict(soft_cap=2.0)),
}


def sinks_for(num_q_heads: int, seed: int = 0):
    # Up to 4: past the soft cap, and large next to these scores (~N(0, 1) to N(0, 2.4)).
    return jnp.asarray(np.random.default_rng(100 + seed).uniform(-1.0, 4.0, num_q_heads), jnp.float32)


# ---- the impls, each as (case, attention options, sinks) -> out [T, Hq, D] ----


@functools.partial(jax.jit, static_argnames=("options",))
def _reference(queries, new_kv, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks, options):
    kv = write_kv_ref(kv_pages, new_kv, kv_lens, page_indices, cu_q_lens, num_seqs)
    return ragged_paged_attention_ref(
        queries, kv, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=sinks, **dict(options)
    )


@functools.partial(jax.jit, static_argnames=("options",))
def _blocked(queries, new_kv, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks, options):
    kv = write_kv_ref(kv_pages, new_kv, kv_lens, page_indices, cu_q_lens, num_seqs)
    return ragged_paged_attention_blocked(
        queries, kv, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=sinks, **dict(options)
    )


def run_impl(impl: str, case, kwargs, sinks, **block):
    args = (case.queries, case.new_kv, case.kv_pages, *case.metadata)
    if impl == "reference":
        return _reference(*args, sinks, tuple(sorted(kwargs.items())))
    if impl == "blocked":
        return _blocked(*args, sinks, tuple(sorted(dict(kwargs, **block).items())))
    if impl == "pallas_tpu_interpret":
        out, _ = ragged_paged_attention_tpu(*args, interpret=RACES, sinks=sinks, **block, **kwargs)
        jax.block_until_ready(out)
        assert not races_found(), "the race detector reported a data race"
        return out
    if impl == "pallas_gpu_interpret":
        out, _ = ragged_paged_attention_gpu(*args, interpret=True, sinks=sinks, **block, **kwargs)
        return out
    raise ValueError(impl)


# Block options per impl: the blocked path at one page a block (many online-softmax steps; chunks of
# more than 4 rows go in tiles), the TPU kernel with blocks straddling sequences and a KV block of
# one page under the window (skipped blocks), the GPU kernel with 2 KV splits (the flash-decoding
# merge must count the sink once).
BLOCKS = {
    "reference": {},
    "blocked": dict(pages_per_block=1, tile_kv_pages=1),
    "pallas_tpu_interpret": dict(num_queries_per_block=3, num_kv_pages_per_block=1),
    "pallas_gpu_interpret": dict(rows_per_tile=16, num_kv_pages_per_block=1, num_kv_splits=2),
}
IMPLS = list(BLOCKS)


# ---- oracle 1: transformers' gpt-oss eager attention ----


def transformers_attention(case, kv_pages, sinks, *, sm_scale, sliding_window=None, soft_cap=None):
    """[num_real_tokens, Hq, D] from transformers' gpt-oss ``eager_attention_forward`` (float64),
    called per sequence on dense [1, H, len, D] tensors gathered from the written cache.

    It has no soft cap; with one, the capped scores reach it through its additive mask
    (logits = q.k * scale + mask), so that the sinks themselves stay uncapped as there."""
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    queries, kv_pages = np.asarray(case.queries, np.float64), np.asarray(kv_pages, np.float64)
    num_q_heads, head_dim = queries.shape[1:]
    num_kv_heads = kv_pages.shape[2] // 2
    page_size = kv_pages.shape[1]
    module = types.SimpleNamespace(
        num_key_value_groups=num_q_heads // num_kv_heads,
        sinks=torch.tensor(np.asarray(sinks, np.float64)),
        training=False,
    )
    kv_lens, page_indices, cu_q_lens = (np.asarray(x) for x in case.metadata[:3])
    outs = []
    for s in range(int(case.num_seqs[0])):
        q_len, kv_len = int(cu_q_lens[s + 1] - cu_q_lens[s]), int(kv_lens[s])
        pages = page_indices[s, : -(-kv_len // page_size)]
        kv = kv_pages[pages].reshape(-1, 2 * num_kv_heads, head_dim)[:kv_len]
        k = torch.tensor(kv[:, 0::2].transpose(1, 0, 2)[None])  # [1, Hkv, kv_len, D]
        v = torch.tensor(kv[:, 1::2].transpose(1, 0, 2)[None])
        q = torch.tensor(queries[cu_q_lens[s] : cu_q_lens[s + 1]].transpose(1, 0, 2)[None])
        q_pos = np.arange(kv_len - q_len, kv_len)[:, None]
        kv_pos = np.arange(kv_len)[None, :]
        visible = kv_pos <= q_pos
        if sliding_window is not None:
            visible &= kv_pos > q_pos - sliding_window
        mask = torch.tensor(np.where(visible, 0.0, torch.finfo(torch.float64).min))[None, None]
        if soft_cap is not None:
            group = num_q_heads // num_kv_heads
            scores = q @ k.repeat_interleave(group, dim=1).transpose(2, 3) * sm_scale
            mask = mask + soft_cap * torch.tanh(scores / soft_cap) - scores
        out, _ = eager_attention_forward(module, q, k, v, mask, scaling=sm_scale)
        outs.append(out[0].numpy())  # [q_len, Hq, D]
    return np.concatenate(outs)


def check(impl: str, case, kwargs, sinks, **block):
    """impl with the sinks == transformers' gpt-oss attention; the sinks matter; padding rows 0."""
    n = case.num_real_tokens
    out = run_impl(impl, case, kwargs, sinks, **block)
    _, kv = cases.expected(case, **kwargs)
    want = transformers_attention(case, kv, sinks, **kwargs)
    np.testing.assert_allclose(cases.f32(out[:n]), want, atol=2e-5, rtol=2e-5)
    assert not np.any(cases.f32(out[n:]))
    # Without the sinks the output is far from the oracle: the comparison above can fail.
    without = cases.f32(cases.oracle(case, kv, **kwargs))
    assert np.max(np.abs(without - want)) > 0.1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SINK_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_sinks_match_transformers_gpt_oss_attention(impl, name):
    base, extra = SINK_CASES[name]
    case, kwargs, _ = cases.build(base)
    kwargs = dict(kwargs, **extra)
    check(impl, case, kwargs, sinks_for(case.queries.shape[1]), **BLOCKS[impl])


# ---- oracle 2: jax's ref_ragged_paged_attention, with sinks that weigh nothing ----


@pytest.mark.timeout(300)
@pytest.mark.parametrize("very_negative", [-np.inf, -1e30], ids=["-inf", "-1e30"])
@pytest.mark.parametrize("name", ["mixed_g3", "window_g8"])
@pytest.mark.parametrize("impl", IMPLS)
def test_sinks_of_minus_infinity_change_nothing(impl, name, very_negative):
    """exp(-inf) = 0 in the denominator: the output is jax's own (sink-free) reference, within its
    tolerance, and the kernels' online softmax must not turn the -inf start into NaN."""
    base, extra = SINK_CASES[name]
    case, kwargs, dtype = cases.build(base, seed=1)
    kwargs = dict(kwargs, **extra)
    sinks = jnp.full((case.queries.shape[1],), very_negative, jnp.float32)
    out = run_impl(impl, case, kwargs, sinks, **BLOCKS[impl])
    _, kv = cases.expected(case, **kwargs)
    n = case.num_real_tokens
    np.testing.assert_allclose(
        cases.f32(out[:n]), cases.f32(cases.oracle(case, kv, **kwargs)), **cases.tolerance(dtype)
    )
    assert not np.any(cases.f32(out[n:]))


# ---- the paths the tests above do not reach ----


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "impl,block",
    [
        ("pallas_tpu_interpret", dict(num_queries_per_block=1, num_kv_pages_per_block=2)),  # decode path
        ("pallas_gpu_interpret", dict(rows_per_tile=32, num_kv_pages_per_block=8, num_kv_splits=1)),
        ("blocked", dict(pages_per_block=4, tail_kv_pages=1)),
    ],
    ids=["tpu_bq1", "gpu_one_split", "blocked_wide_then_tail"],
)
def test_sinks_other_block_shapes(impl, block):
    case, kwargs, _ = cases.build("mixed_g3_d128", seed=2)
    check(impl, case, kwargs, sinks_for(case.queries.shape[1], seed=2), **block)


@pytest.mark.timeout(300)
def test_sinks_with_the_blocked_shared_prefix_cascade():
    """Sequences sharing their first pages: the cascade pass and the per-sequence passes each see
    part of a row's keys, and the sink must enter that row's denominator once."""
    seqs = [(20, 60), (9, 50), (1, 45), (33, 80)]
    case = cases.make_case(
        13,
        seqs,
        num_slots=6,
        page_size=4,
        pages_per_seq=24,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=64,
        num_tokens=96,
    )
    table = np.asarray(case.page_indices).copy()
    table[1 : len(seqs), :10] = table[0, :10]
    case = dataclasses.replace(case, page_indices=jnp.asarray(table))
    assert int(common_prefix_pages(*case.metadata, page_size=4)) == 10  # the cascade path runs
    sinks = sinks_for(6, seed=3)
    check("blocked", case, dict(sm_scale=0.125), sinks, pages_per_block=2)
    check("blocked", case, dict(sm_scale=0.2, soft_cap=5.0), sinks, pages_per_block=3, tile_kv_pages=1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", ["blocked", "pallas_tpu_interpret"])
def test_dispatch_per_layer_sinks_in_layer_scan(impl):
    """dispatch == 'reference' the way a model calls it: a jitted scan over layers, each layer's
    sinks row picked by the traced layer index (layer 1's differ, so a wrong row shows)."""
    case, kwargs, _ = cases.build("window_g8", seed=4)
    cache = jnp.stack([case.kv_pages, case.kv_pages])
    new_k, new_v = split_kv(case.new_kv)
    md = AttentionMetadata(*case.metadata)
    params = AttentionParams(**kwargs)
    hq = case.queries.shape[1]
    layer_sinks = jnp.stack([sinks_for(hq, seed=5), sinks_for(hq, seed=6) - 2.0])  # [L, Hq]

    def step(impl):
        def layer(c, i):
            out, c = ragged_paged_attention(
                case.queries, new_k, new_v, c, i, md, params, impl, sinks=layer_sinks[i]
            )
            return c, out

        return jax.jit(lambda c: jax.lax.scan(layer, c, jnp.arange(2, dtype=jnp.int32)))(cache)

    got_kv, got = step(impl)
    want_kv, want = step("reference")
    np.testing.assert_array_equal(cases.f32(got_kv), cases.f32(want_kv))
    np.testing.assert_allclose(cases.f32(got), cases.f32(want), atol=1e-5, rtol=1e-5)
    n = case.num_real_tokens
    for i in range(2):
        oracle = transformers_attention(case, want_kv[i], layer_sinks[i], **kwargs)
        np.testing.assert_allclose(cases.f32(got[i, :n]), oracle, atol=2e-5, rtol=2e-5)
    assert np.max(np.abs(cases.f32(got[0]) - cases.f32(got[1]))) > 0.1


def test_sinks_of_the_wrong_shape_are_refused():
    case, kwargs, _ = cases.build("mixed_g3_d128")
    for impl in IMPLS:
        with pytest.raises(ValueError, match=r"sinks must be one logit per query head, shape \(6,\)"):
            run_impl(impl, case, kwargs, jnp.zeros((2,), jnp.float32), **BLOCKS[impl])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dispatch_sinks_under_tensor_parallelism():
    """TP=2 over fake CPU devices: the sinks split over the heads axis like the query heads, and
    each impl's output equals its single-device output (sinks_tp_child.py)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    res = subprocess.run(
        [sys.executable, os.path.join(HERE, "sinks_tp_child.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        cwd=HERE,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    for impl in ("reference", "blocked"):
        assert f"OK {impl} TP=2" in res.stdout, res.stdout


# ---- (c) the compiled TPU kernel with sinks, exported for a TPU without one ----


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sliding_window", [None, 128], ids=["full", "window128"])
def test_pallas_tpu_kernel_with_sinks_exports_for_tpu(sliding_window):
    """jax.export for platforms=["tpu"] at gpt-oss-20b's attention shape (64 query / 8 KV heads of
    64, bf16 cache, 128-token window on alternate layers): the sinks are an f32 [64] operand of the
    Mosaic call, and the kernel differs from the sink-free one."""
    tokens, slots, hq, hkv, d, layers, pages, ps, pps = 64, 16, 64, 8, 64, 2, 257, 16, 16
    shapes = (
        jax.ShapeDtypeStruct((tokens, hq, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens, 2 * hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((layers, pages, ps, 2 * hkv, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots, pps), jnp.int32),
        jax.ShapeDtypeStruct((slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )

    def export(with_sinks: bool):
        def fn(*args):
            *args, sinks = args if with_sinks else (*args, None)
            return ragged_paged_attention_tpu_stacked(
                *args, sm_scale=0.125, sliding_window=sliding_window, sinks=sinks
            )

        extra = (jax.ShapeDtypeStruct((hq,), jnp.float32),) if with_sinks else ()
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*shapes, *extra)

    exported = export(True)
    assert exported.platforms == ("tpu",)
    assert exported.in_avals[-1] == jax.core.ShapedArray((hq,), jnp.float32)
    text = exported.mlir_module()
    assert text.count("tpu_custom_call") == 1
    call = next(line for line in text.splitlines() if "tpu_custom_call" in line)
    assert "tensor<64xf32>" in call  # the sinks reach the kernel itself
    assert "tensor<64xf32>" not in next(
        line for line in export(False).mlir_module().splitlines() if "tpu_custom_call" in line
    )

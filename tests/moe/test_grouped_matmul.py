"""The Pallas TPU grouped matmul in TPU interpret mode (race detection on) against three oracles.

Oracles: ``jax.lax.ragged_dot`` (XLA's own grouped matmul, HIGHEST precision, f32 result),
jax's megablox ``gmm`` Pallas kernel run in the same interpret mode (written by others; it leaves
rows past ``sum(group_sizes)`` unwritten, so it is compared on the grouped rows only, and it needs
M to be a multiple of its row tile, so its input is zero-padded), and our jnp reference. Grids
are tiny (interpret mode costs milliseconds per step) but cover row tiles crossed by several group
boundaries, empty groups (first, middle, last), M not a multiple of the tile, rows past the sum,
several K and N tiles, a partial last N tile, f32 and bf16.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm
from pallas_interpret import RACES, fresh_interpreter, races_found  # noqa: F401 (autouse fixture)

from tpuserve.moe.grouped_matmul import grouped_matmul, grouped_matmul_reference
from tpuserve.moe.pallas_tpu_gmm import (
    FP4_DECODES,
    FP4_DEFAULT_DECODE,
    default_tiling,
    grouped_matmul_tpu,
    visit_schedule,
)
from tpuserve.quant import fp4, fp8


def data(m, k, g, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((g, k, n)) / np.sqrt(k)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def ragged_dot_oracle(x, w, sizes):
    return jax.lax.ragged_dot(
        x, w, sizes, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def megablox_oracle(x, w, sizes, tk, tn):
    """megablox on rows zero-padded to its 8-row tile; valid on the grouped rows only."""
    m = x.shape[0]
    mp = -(-m // 8) * 8
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    y = megablox_gmm(xp, w, sizes, preferred_element_type=jnp.float32, tiling=(8, tk, tn), interpret=RACES)
    assert not races_found(), "the race detector reported a data race in megablox (the oracle)"
    return y[:m]


def close(got, want, dtype, rows=None):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if rows is not None:
        got, want = got[:rows], want[:rows]
    scale = max(float(np.max(np.abs(want))), 1e-6)
    np.testing.assert_allclose(got / scale, want / scale, **tol)


# name: (group sizes, M, K, N, dtype, tiling or None for the defaults)
CASES = {
    # sum 37 of M = 44: tiles of 8 rows, tile 0 holds groups 0 and 2, tile 3 groups 2, 4 and 5;
    # the last tile is partial (rows 40..43) and wholly past the sum; 2 K tiles, 2 N tiles
    "uneven_empty_f32": ([5, 0, 19, 0, 3, 10], 44, 256, 256, jnp.float32, (8, 128, 128)),
    # bf16, sum = M, empty first and last groups, a 1-row group inside a tile
    "uneven_bf16": ([0, 33, 1, 14, 16, 0], 64, 256, 128, jnp.bfloat16, (16, 128, 128)),
    # the defaults: one row tile of M = 24 rows (the full dim), 8 groups, K and N whole
    "defaults_small_m_bf16": ([3, 0, 4, 1, 7, 2, 0, 5], 24, 128, 384, jnp.bfloat16, None),
    # a partial last N tile (320 = 2 x 128 + 64), K and N below 128 lanes elsewhere not needed
    "partial_n_f32": ([9, 12, 0, 6], 32, 128, 320, jnp.float32, (8, 128, 128)),
    # K not a multiple of 128 (one whole-K tile), N whole, M padded (30 rows, tiles of 16)
    "odd_k_bf16": ([7, 0, 11, 9], 30, 96, 200, jnp.bfloat16, (16, 96, 200)),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_ragged_dot_megablox_and_reference(name):
    sizes, m, k, n, dtype, tiling = CASES[name]
    g = len(sizes)
    total = sum(sizes)
    x, w = data(m, k, g, n, dtype, seed=len(name))
    gs = jnp.asarray(sizes, jnp.int32)
    y = grouped_matmul_tpu(x, w, gs, tiling=tiling, interpret=RACES)
    jax.block_until_ready(y)
    assert not races_found(), "the race detector reported a data race"
    assert y.shape == (m, n) and y.dtype == dtype
    assert not np.any(np.asarray(y[total:], np.float32)), "rows past sum(group_sizes) must be zero"
    close(y, ragged_dot_oracle(x, w, gs), dtype)
    close(y, grouped_matmul_reference(x, w, gs), dtype)
    tk, tn = (tiling or default_tiling(m, k, n))[1:]
    close(y, megablox_oracle(x, w, gs, tk, tn), dtype, rows=total)


@pytest.mark.timeout(300)
def test_all_groups_empty_gives_zeros():
    x, w = data(24, 128, 3, 128, jnp.float32)
    y = grouped_matmul_tpu(x, w, jnp.zeros((3,), jnp.int32), tiling=(8, 128, 128), interpret=RACES)
    assert not races_found()
    np.testing.assert_array_equal(np.asarray(y), 0.0)


@pytest.mark.timeout(300)
def test_dispatch_interpret_matches_reference_under_jit():
    # group sizes are traced (one program for every routing), as the MoE layer will call it
    x, w = data(40, 128, 5, 256, jnp.bfloat16, seed=3)

    @jax.jit
    def both(gs):
        return (
            grouped_matmul(x, w, gs, impl="pallas_tpu_interpret", tiling=(16, 128, 128)),
            grouped_matmul(x, w, gs, impl="reference"),
        )

    for sizes in ([8, 8, 8, 8, 8], [0, 0, 37, 0, 1]):
        got, want = both(jnp.asarray(sizes, jnp.int32))
        close(got, want, jnp.bfloat16)
        close(got, ragged_dot_oracle(x, w, jnp.asarray(sizes, jnp.int32)), jnp.bfloat16)
    with pytest.raises(ValueError, match="impl"):
        grouped_matmul(x, w, jnp.zeros((5,), jnp.int32), impl="cuda")


def quantize_per_channel(w, kind):
    """Stacked experts ``[G, K, N]`` -> (8-bit codes, f32 scales ``[G, 1, N]``). fp8 through the
    repo's own record (``quant.fp8``, "channel": one scale per expert and output column)."""
    if kind == "fp8":
        rec = fp8.quantize_fp8(w, "channel", num_lead=1)
        assert rec.qweight.shape == w.shape and rec.scale.shape == (w.shape[0], 1, w.shape[2])
        return rec.qweight, rec.scale
    scale = jnp.max(jnp.abs(w), axis=1, keepdims=True) / 127.0
    return jnp.round(w / scale).astype(jnp.int8), scale


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_rhs_matches_ragged_dot_on_the_dequantized_weight(kind):
    # sum 28: rows 28..31 past it; K = 640 is one tile widened in two chunks (512 + 128 rows)
    sizes, m, k, n = [6, 0, 13, 9], 32, 640, 256
    x, w = data(m, k, len(sizes), n, jnp.bfloat16, seed=11)
    q, scale = quantize_per_channel(w.astype(jnp.float32), kind)
    gs = jnp.asarray(sizes, jnp.int32)
    y = grouped_matmul_tpu(x, q, gs, scale, tiling=(16, 640, 128), interpret=RACES)
    jax.block_until_ready(y)
    assert not races_found(), "the race detector reported a data race"
    # the dequantized weight by numpy / ml_dtypes' casts, not ours
    deq = jnp.asarray(np.asarray(q).astype(np.float32) * np.asarray(scale))
    close(y, ragged_dot_oracle(x.astype(jnp.float32), deq, gs), jnp.bfloat16)
    close(y, grouped_matmul_reference(x, q, gs, scale), jnp.bfloat16)
    assert not np.any(np.asarray(y[sum(sizes) :], np.float32))
    with pytest.raises(ValueError, match="rhs_scale"):
        grouped_matmul_tpu(x, q, gs, scale[:, :, :128], interpret=RACES)


def brute_force_visits(sizes, m, tm):
    """(tile, group, lo, hi) of every visit with rows, then (tile, -1, 0, 0) for tiles past the sum."""
    visits, start = [], 0
    for gi, s in enumerate(sizes):
        for t in range(m // tm + 1):
            lo, hi = max(start, t * tm), min(start + s, (t + 1) * tm)
            if lo < hi:
                visits.append((t, gi, lo, hi))
        start += s
    used = -(-start // tm)
    return visits + [(t, -1, 0, 0) for t in range(used, -(-m // tm))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("g,m,tm", [(1, 16, 8), (6, 53, 1), (6, 53, 8), (9, 40, 16), (9, 64, 16)])
def test_visit_schedule_matches_brute_force(g, m, tm):
    num = -(-m // tm) + min(g, m) - 1
    schedule = jax.jit(visit_schedule, static_argnums=(1, 2, 3))
    rng = np.random.default_rng(g * m + tm)
    for trial in range(25):
        sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(g) / g) * (rng.random(g) < 0.7)
        want = brute_force_visits(sizes.tolist(), m, tm)
        out_tile, in_tile, group, lo, hi, real = (
            np.asarray(a) for a in schedule(jnp.asarray(sizes, jnp.int32), m, tm, num)
        )
        real = int(real)
        assert len(want) <= num and real == len(want), (trial, sizes)
        got = [(out_tile[v], group[v] if lo[v] < hi[v] else -1, lo[v], hi[v]) for v in range(real)]
        assert [tuple(map(int, t)) for t in got] == want, (trial, sizes)
        # idle visits write nothing and stay on the last tile; busy visits fetch their own blocks
        assert np.all(lo[real:] == hi[real:]) and np.all(out_tile[real:] == out_tile[real - 1])
        busy = lo < hi
        assert np.all(in_tile[busy] == out_tile[busy])


def test_bad_tiles_are_refused():
    x, w = data(32, 256, 2, 256, jnp.bfloat16)
    gs = jnp.asarray([16, 16], jnp.int32)
    with pytest.raises(ValueError, match="tk"):
        grouped_matmul_tpu(x, w, gs, tiling=(16, 192, 128), interpret=RACES)
    with pytest.raises(ValueError, match="tm"):
        grouped_matmul_tpu(x, w, gs, tiling=(8, 128, 128), interpret=RACES)  # bf16 needs 16 rows
    with pytest.raises(ValueError, match="tn"):
        grouped_matmul_tpu(x, w, gs, tiling=(16, 128, 100), interpret=RACES)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "m,k,g,n,dtype",
    [
        (512, 2048, 128, 768, jnp.bfloat16),  # Qwen3-30B-A3B-like gate/up: 64 tokens x top-8
        (64, 768, 128, 2048, jnp.bfloat16),  # its down projection, decode-sized
        (200, 2880, 32, 2880, jnp.bfloat16),  # gpt-oss-20b-like: K one tile, N with a partial tile
        (100, 256, 4, 384, jnp.float32),
        (512, 2048, 128, 768, jnp.int8),  # int8 experts, per-channel scales, bf16 activations
        (64, 2880, 32, 2880, jnp.float8_e4m3fn),
    ],
    ids=["qwen3_up", "qwen3_down", "gpt_oss", "f32", "qwen3_up_int8", "gpt_oss_fp8"],
)
def test_lowers_to_mosaic(m, k, g, n, dtype):
    """The kernel exports for TPU from CPU (Mosaic lowering, default tiling; the layout passes run
    only on a TPU: benchmarks/moe_gmm_tpu.py compiles and runs it there)."""
    act = dtype if jnp.dtype(dtype).itemsize > 1 else jnp.bfloat16
    shapes = [
        jax.ShapeDtypeStruct((m, k), act),
        jax.ShapeDtypeStruct((g, k, n), dtype),
        jax.ShapeDtypeStruct((g,), jnp.int32),
    ]
    if act != dtype:
        shapes.append(jax.ShapeDtypeStruct((g, 1, n), jnp.float32))
    exported = jax.export.export(jax.jit(lambda *a: grouped_matmul_tpu(*a)), platforms=["tpu"])(*shapes)
    assert "tpu_custom_call" in exported.mlir_module()
    assert exported.out_avals[0].shape == (m, n) and exported.out_avals[0].dtype == act


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_stacked_layers_read_the_given_layers_experts(kind):
    """rhs [L, G, K, N] with a traced layer (what a layer scan passes, unsliced): the kernel
    fetches that layer's blocks, equal to the unstacked call on rhs[layer] and to the reference."""
    sizes = jnp.asarray([5, 0, 9, 2], jnp.int32)
    xs, ws = zip(*(data(16, 128, 4, 256, jnp.bfloat16, seed=s) for s in range(3)))
    x, w = xs[0], jnp.stack(ws)  # [3, 4, 128, 256]
    scale = None
    if kind == "fp8":
        recs = [fp8.quantize_fp8(wl.astype(jnp.float32), "channel", num_lead=1) for wl in ws]
        w, scale = jnp.stack([r.qweight for r in recs]), jnp.stack([r.scale for r in recs])

    @jax.jit
    def stacked(layer):
        return grouped_matmul_tpu(x, w, sizes, scale, layer, tiling=(16, 128, 128), interpret=RACES)

    for layer in (1, 2, 0):
        got = stacked(jnp.int32(layer))
        assert not races_found(), "the race detector reported a data race"
        one_scale = None if scale is None else scale[layer]
        alone = grouped_matmul_tpu(x, w[layer], sizes, one_scale, tiling=(16, 128, 128), interpret=RACES)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(alone, np.float32))
        want = grouped_matmul(x, w, sizes, scale, jnp.int32(layer), impl="reference")
        close(got, want, jnp.bfloat16)
        # a different layer gives a different answer, so the layer index is really used
        other = grouped_matmul_reference(
            x, w[(layer + 1) % 3], sizes, None if scale is None else scale[(layer + 1) % 3]
        )
        assert not np.allclose(np.asarray(got, np.float32), np.asarray(other, np.float32), atol=1e-2)
    with pytest.raises(ValueError, match=r"\[L, G, K, N\]"):
        grouped_matmul_tpu(x, w[0], sizes, None, jnp.int32(0), interpret=RACES)


@pytest.mark.timeout(240)
def test_stacked_layers_lower_to_mosaic():
    """Qwen3-30B-A3B's gate/up stacked over 48 layers, the layer a traced scalar: exports for TPU."""
    shapes = [
        jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((48, 128, 2048, 1536), jnp.bfloat16),
        jax.ShapeDtypeStruct((128,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    ]
    fn = jax.jit(lambda x, w, gs, layer: grouped_matmul_tpu(x, w, gs, None, layer))
    exported = jax.export.export(fn, platforms=["tpu"])(*shapes)
    assert "tpu_custom_call" in exported.mlir_module()
    assert exported.out_avals[0].shape == (8, 1536)


# ---------------------------------------------------------------------------------------------
# MXFP4 experts: packed u8 [G, K/2, N] with e8m0 scales [G, K/32, N], decoded in the kernel.


def mxfp4_experts(g, k, n, seed=0, layers=None):
    """Random experts quantized by the repo's own ``quantize_mxfp4`` (blocks of 32 along K), with
    block scales spread over several binades so a wrong scale row shows."""
    rng = np.random.default_rng(seed)
    lead = (g,) if layers is None else (layers, g)
    w = rng.standard_normal((*lead, k, n)).astype(np.float32) / np.sqrt(k)
    w *= 2.0 ** rng.integers(-3, 4, size=(*lead, k // 32, 1, n)).repeat(32, axis=-3).reshape(w.shape)
    rec = fp4.quantize_mxfp4(w, num_lead=len(lead))
    assert rec.packed.shape == (*lead, k // 2, n) and rec.scale.shape == (*lead, k // 32, n)
    return rec


def dequantized(rec):
    """The weight ``[*L, K, N]`` by quant/fp4.py's reference decoder (the second oracle's input)."""
    return fp4.dequantize_mxfp4(rec).reshape(*rec.packed.shape[:-2], rec.in_features, rec.out_features)


# name: (group sizes, M, K, N, dtype, tiling or None for the defaults)
MXFP4_CASES = {
    # sum 37 of M = 44 (rows past it, a partial last row tile), empty groups, 2 N tiles; K = 96
    # is 3 blocks (48 byte rows: one chunk, one tile)
    "uneven_empty_f32": ([5, 0, 19, 0, 3, 10], 44, 96, 256, jnp.float32, (8, 96, 128)),
    # 2 K tiles of 1024 (each two 256-byte-row chunks and 32 scale rows), bf16 activations
    "two_k_tiles_bf16": ([0, 9, 1, 14, 0], 32, 2048, 128, jnp.bfloat16, (16, 1024, 128)),
    # the defaults (one whole-K tile, N whole), K = 576: 18 blocks, 288 byte rows decoded as a
    # 256-row chunk and a 32-row one
    "defaults_bf16": ([3, 0, 4, 1, 7, 2, 0, 5], 24, 576, 384, jnp.bfloat16, None),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("decode", FP4_DECODES)
@pytest.mark.parametrize("name", list(MXFP4_CASES))
def test_mxfp4_rhs_matches_ragged_dot_on_the_dequantized_weight_and_reference(name, decode):
    sizes, m, k, n, dtype, tiling = MXFP4_CASES[name]
    g, total = len(sizes), sum(sizes)
    x, _ = data(m, k, 1, 1, dtype, seed=len(name))
    rec = mxfp4_experts(g, k, n, seed=len(name) + 1)
    gs = jnp.asarray(sizes, jnp.int32)
    y = grouped_matmul_tpu(x, rec, gs, tiling=tiling, fp4_decode=decode, interpret=RACES)
    jax.block_until_ready(y)
    assert not races_found(), "the race detector reported a data race"
    assert y.shape == (m, n) and y.dtype == dtype
    assert not np.any(np.asarray(y[total:], np.float32)), "rows past sum(group_sizes) must be zero"
    close(y, ragged_dot_oracle(x.astype(jnp.float32), dequantized(rec), gs), dtype)
    close(y, grouped_matmul_reference(x, rec, gs), dtype)
    close(y, grouped_matmul(x, rec, gs, impl="reference"), dtype)
    if decode != FP4_DEFAULT_DECODE:
        return
    # the dispatch's interpret path with traced group sizes (as the MoE layer calls it): the same bits
    via = jax.jit(lambda sz: grouped_matmul(x, rec, sz, impl="pallas_tpu_interpret", tiling=tiling))(gs)
    np.testing.assert_array_equal(np.asarray(via, np.float32), np.asarray(y, np.float32))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("decode", FP4_DECODES)
def test_mxfp4_swapped_nibbles_or_shifted_scales_break_it(decode):
    """The comparison can fail: the same bytes read with the other nibble order (GGUF-style
    confusion) or with each block's scale moved to its neighbour give a different product."""
    sizes, m, k, n = [7, 0, 9], 16, 128, 128
    x, _ = data(m, k, 1, 1, jnp.float32, seed=5)
    rec = mxfp4_experts(len(sizes), k, n, seed=6)
    gs = jnp.asarray(sizes, jnp.int32)
    y = np.asarray(grouped_matmul_tpu(x, rec, gs, tiling=(8, 128, 128), fp4_decode=decode, interpret=RACES))
    swapped = fp4.Mxfp4Weight((rec.packed >> 4) | (rec.packed << 4), rec.scale, rec.out_shape)
    rolled = fp4.Mxfp4Weight(rec.packed, jnp.roll(rec.scale, 1, axis=-2), rec.out_shape)
    for wrong in (swapped, rolled):
        want = np.asarray(grouped_matmul_reference(x, wrong, gs))
        assert not np.allclose(y, want, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(y, np.asarray(grouped_matmul_reference(x, rec, gs)), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_mxfp4_all_groups_empty_gives_zeros_and_bad_inputs_are_refused():
    x, _ = data(24, 64, 1, 1, jnp.bfloat16)
    rec = mxfp4_experts(3, 64, 128)
    y = grouped_matmul_tpu(x, rec, jnp.zeros((3,), jnp.int32), tiling=(16, 64, 128), interpret=RACES)
    assert not races_found()
    np.testing.assert_array_equal(np.asarray(y, np.float32), 0.0)
    gs = jnp.asarray([8, 8, 8], jnp.int32)
    with pytest.raises(ValueError, match="tk"):  # several K tiles must be multiples of 1024
        grouped_matmul_tpu(x, rec, gs, tiling=(16, 32, 128), interpret=RACES)
    with pytest.raises(ValueError, match="own scales"):
        grouped_matmul_tpu(x, rec, gs, jnp.ones((3, 1, 128)), interpret=RACES)
    with pytest.raises(ValueError, match="rotated"):
        grouped_matmul_tpu(x, dataclasses.replace(rec, rotated=True), gs, interpret=RACES)
    with pytest.raises(ValueError, match="natural K order"):  # the dense kernel's tiled order
        grouped_matmul_tpu(x, dataclasses.replace(rec, k_tile=64), gs, interpret=RACES)
    with pytest.raises(ValueError, match="MXFP4"):
        grouped_matmul_tpu(x, dataclasses.replace(rec, scale=rec.scale[:, :1]), gs, interpret=RACES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("decode", FP4_DECODES)
def test_mxfp4_stacked_layers_read_the_given_layers_experts(decode):
    sizes = jnp.asarray([5, 0, 9, 2], jnp.int32)
    x, _ = data(16, 128, 1, 1, jnp.bfloat16, seed=9)
    rec = mxfp4_experts(4, 128, 256, seed=10, layers=3)  # packed [3, 4, 64, 256]
    tiles = (16, 128, 128)

    @jax.jit
    def stacked(layer):
        return grouped_matmul_tpu(
            x, rec, sizes, None, layer, tiling=tiles, fp4_decode=decode, interpret=RACES
        )

    for layer in (1, 2, 0):
        got = stacked(jnp.int32(layer))
        assert not races_found(), "the race detector reported a data race"
        one = jax.tree_util.tree_map(lambda a, layer=layer: a[layer], rec)
        alone = grouped_matmul_tpu(x, one, sizes, tiling=tiles, fp4_decode=decode, interpret=RACES)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(alone, np.float32))
        close(got, grouped_matmul(x, rec, sizes, None, jnp.int32(layer), impl="reference"), jnp.bfloat16)
        close(got, ragged_dot_oracle(x.astype(jnp.float32), dequantized(one), sizes), jnp.bfloat16)
        other = jax.tree_util.tree_map(lambda a, layer=layer: a[(layer + 1) % 3], rec)
        assert not np.allclose(
            np.asarray(got, np.float32),
            np.asarray(grouped_matmul_reference(x, other, sizes), np.float32),
            atol=1e-2,
        )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("decode", FP4_DECODES)
@pytest.mark.parametrize(
    "m,k,n,layers",
    [(64, 2880, 5760, None), (64, 2880, 2880, None), (8, 2880, 5760, 24)],
    ids=["gpt_oss_gate_up", "gpt_oss_down", "gpt_oss_gate_up_stacked"],
)
def test_mxfp4_lowers_to_mosaic_at_gpt_oss_shapes(m, k, n, layers, decode):
    """gpt-oss-20b's experts (32, K = 2880 = 90 blocks: one whole-K tile of 1440 byte rows), packed,
    export for TPU from CPU with the default tiling (Mosaic lowering; not its TPU-only passes)."""
    g = 32
    lead = (g,) if layers is None else (layers, g)

    def fn(x, packed, scale, gs, *layer):
        rec = fp4.Mxfp4Weight(packed, scale, (n,))
        return grouped_matmul_tpu(x, rec, gs, None, *layer, fp4_decode=decode)

    shapes = [
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((*lead, k // 2, n), jnp.uint8),
        jax.ShapeDtypeStruct((*lead, k // 32, n), jnp.uint8),
        jax.ShapeDtypeStruct((g,), jnp.int32),
    ]
    if layers is not None:
        shapes.append(jax.ShapeDtypeStruct((), jnp.int32))
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*shapes)
    assert "tpu_custom_call" in exported.mlir_module()
    assert exported.out_avals[0].shape == (m, n) and exported.out_avals[0].dtype == jnp.bfloat16


def _eqns_outside_kernels(jaxpr):
    """Every equation of ``jaxpr`` and of the jitted calls in it, but not the Pallas kernels'."""
    for e in jaxpr.eqns:
        yield e
        sub = e.params.get("jaxpr") if e.primitive.name != "pallas_call" else None
        if sub is not None:
            yield from _eqns_outside_kernels(getattr(sub, "jaxpr", sub))


@pytest.mark.parametrize("decode", FP4_DECODES)
def test_mxfp4_bytes_reach_the_kernel_untouched(decode):
    """The packed experts and their scales go into the pallas_call as the u8 arrays they are: a
    bitcast to int8 outside the kernel made XLA:TPU write a copy of every layer's experts each step
    (9.5 GB a step for gpt-oss-20b; its b1 decode 4.6 -> 2.2 ms on a 2-layer model without it)."""
    g, k, n, layers = 4, 2880, 256, 3

    def fn(x, packed, scale, gs, layer):
        return grouped_matmul_tpu(x, fp4.Mxfp4Weight(packed, scale, (n,)), gs, None, layer, fp4_decode=decode)

    packed = jax.ShapeDtypeStruct((layers, g, k // 2, n), jnp.uint8)
    scale = jax.ShapeDtypeStruct((layers, g, k // 32, n), jnp.uint8)
    args = (jax.ShapeDtypeStruct((8, k), jnp.bfloat16), packed, scale, jax.ShapeDtypeStruct((g,), jnp.int32))
    closed = jax.make_jaxpr(fn)(*args, jax.ShapeDtypeStruct((), jnp.int32))
    eqns = list(_eqns_outside_kernels(closed.jaxpr))
    kernels = [e for e in eqns if e.primitive.name == "pallas_call"]
    assert len(kernels) == 1
    weights = {(packed.shape, packed.dtype), (scale.shape, scale.dtype)}
    touched = [
        e.primitive.name
        for e in eqns
        if e.primitive.name not in ("pallas_call", "pjit", "jit")  # calls: their insides are listed
        and any((getattr(v.aval, "shape", None), getattr(v.aval, "dtype", None)) in weights for v in e.invars)
    ]
    assert not touched, touched
    into_kernel = {(v.aval.shape, v.aval.dtype) for v in kernels[0].invars}
    assert weights <= into_kernel

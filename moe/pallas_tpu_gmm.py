"""Pallas TPU grouped matmul: each group of consecutive rows of ``lhs`` times its own ``rhs[g]``.

Contract (the jnp reference is ``moe.grouped_matmul.grouped_matmul_reference``):
``lhs [M, K]`` rows sorted by group, ``rhs [G, K, N]``, ``group_sizes [G]`` int32 with
``sum <= M``; rows ``start_g .. start_g + size_g - 1`` of the result are ``lhs[rows] @ rhs[g]``,
rows past ``sum(group_sizes)`` are zero. Output in ``lhs.dtype``, accumulated in f32.

Visit schedule
--------------
Rows are cut into tiles of ``tm``. A tile may hold rows of several groups, so the kernel walks a
list of *visits*, each one (row tile, group): the tile's rows of that group times ``rhs[group]``.
Visits run group by group, so row tiles come in non-decreasing order and all visits of one tile
are consecutive. That lets the output tile stay in VMEM across them: Pallas only writes an output
block back to HBM when its block index changes, so the first visit of a tile writes every row
(its own rows, zero elsewhere) and later ones overwrite only their own rows.

The list is built with jnp from ``group_sizes`` (``visit_schedule``, a handful of tiny vector
ops) and handed to the kernel as scalar-prefetch operands in SMEM, where the index maps read it
to choose the ``lhs`` tile and the ``rhs`` group to DMA. Its length is static: a tile crossed by
a group boundary is visited once more per boundary, so ``tiles + min(G, M) - 1`` visits always
suffice. Tiles wholly past ``sum(group_sizes)`` get one visit that only writes zeros; the static
list is padded with idle visits that repeat the last tile and group, so they cost a grid step
but no DMA and no matmul (idle and zero visits also point their ``lhs`` / ``rhs`` block at the
one the previous step used, so the pipeline has nothing to fetch). Empty groups have no visit.

Grid and tiles
--------------
grid = (N / tn, visits, K / tk), semantics ("parallel", "arbitrary", "arbitrary"). The N tile is
outermost so the visits of a row tile stay consecutive for each N tile. An f32 ``[tm, tn]`` VMEM
accumulator is zeroed at k == 0 and stored, masked to the visit's rows with a select (never a
multiply: rows outside the visit can hold garbage from a partial edge block), at the last k.

Rows: ``tm`` rows per tile (default 128, the v5e MXU's height); ``M`` itself when smaller (a full
dim is always a legal block). M need not divide by ``tm``: the last tile is a partial block whose
out-of-range rows are never selected and are dropped on write-back. N: ``tn`` a multiple of 128
(default: N itself up to 1024 lanes, else the largest 128-multiple divisor <= 1024, else 512 with a
partial last block; columns are independent, so garbage columns past N only reach dropped output
columns). K: ``tk`` must divide K (a partial K block would add garbage into the sum) and be a
multiple of 128 or K itself (default: K up to 3072, else the largest 128-multiple divisor <= 2048).
``rhs`` is cast to ``lhs.dtype`` in VMEM when the two differ.

Quantized experts
-----------------
``rhs`` may be int8 or float8_e4m3fn with a per-output-channel f32 ``rhs_scale [G, 1, N]`` (the
``Fp8Weight`` "channel" record of ``quant/fp8.py`` with the experts as its leading axis): the
8-bit tile is widened to ``lhs.dtype`` in VMEM 512 K rows at a time (int8 through f32: exact;
chunks bound the widened copy at 512 x tn values whatever tk is) and, since the scale does not
vary along K, it multiplies the f32 accumulator once at the store instead of every weight.
HBM moves one byte per weight plus ``4 * N`` bytes of scale per expert. 8-bit tiles need ``tk`` a
multiple of 32 rows (their sublane tile) or K itself.

MXFP4 experts
-------------
``rhs`` may be an ``Mxfp4Weight`` (``quant/fp4.py``) whose leading axis is the experts: ``packed``
u8 ``[G, K/2, N]`` (byte ``[i, n]``: k = 2i in the low nibble, 2i + 1 in the high one) and e8m0
``scale`` u8 ``[G, K/32, N]``; stacked, ``[L, G, K/2, N]`` and ``[L, G, K/32, N]`` with ``layer``.
The bytes stay packed in HBM and are decoded in VMEM, the way ``quant/pallas_tpu_matmul.py``'s
dense FP4 kernel does: ``lhs`` is split once, outside, into its even and odd K columns (``[M, K/2]``
each), so low nibbles multiply the even half and high nibbles the odd half and the kernel never
interleaves rows. Per chunk of 256 byte rows (512 K values) the nibbles are decoded to f32 with
integer ops and a bitcast (``codecs.e2m1_bits_decode``: no gathers, no fp4 dtype in VMEM), times
their block's scale (``e8m0_bits_decode``, each scale row broadcast over the 16 byte rows it
covers), cast to ``lhs.dtype`` (exact: an e2m1 value times a power of two has 2 significant bits)
and fed to two half-K dots accumulating in f32. Packed bytes and scales reach the kernel as the
u8 arrays the record holds: a ``bitcast_convert_type`` to int8 outside it was not free on a v5e
(XLA:TPU wrote a copy of every layer's experts each step: 9.5 GB for gpt-oss-20b).
HBM moves ``K * N * (1/2 + 1/32)`` bytes per expert, 0.27x of bf16. ``tk`` must be K itself or a
multiple of 1024 (its 32 scale rows are then one u8 sublane tile; K itself covers gpt-oss's 2880,
90 blocks), and K a multiple of 32. ``fp4_decode="swar"`` decodes the same weights bit for bit
two bf16 per 32-bit lane instead (quant/fp4_swar.py: the bytes of a chunk read as int32 words of
8 codes, ``lhs`` permuted outside into 4 column groups of K/4 to match the decoded rows; ~5.5 VPU
ops a weight against ~20); the default, being faster on the chip.

Traffic: with one K tile (the default up to K = 3072) a block index that does not change between
grid steps is not fetched again, so each N tile reads every expert's weight once (its visits are
consecutive) and every row tile of ``lhs`` once (likewise); with several K tiles each visit walks
K again and re-reads both. Per visit the MXU still does a full ``[tm, K] @ [K, tn]``, so a tile
shared by many groups (decode: a few rows per expert) costs one matmul per group in it.

Status: verified in TPU interpret mode (race detection on) on CPU and lowered to Mosaic for TPU
(tests/moe/test_grouped_matmul.py); compiled and timed on a v5e by benchmarks/moe_gmm_tpu.py
(benchmarks/RESULTS.md, "Mixture of experts on a TPU v5e"), bf16, int8 and gpt-oss's K = 2880.
The MXFP4 path is verified in interpret mode and exported for TPU at gpt-oss-20b's expert shapes,
and compiled and checked on a v5e at them (both decodes on 2026-12-05 with the int8 bitcast; the
SWAR default again on 2026-12-06 23:23 with the u8 bytes as they are; RESULTS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuserve.quant.codecs import e2m1_bits_decode, e8m0_bits_decode
from tpuserve.quant.fp4 import MXFP4_BLOCK, Mxfp4Weight
from tpuserve.quant.fp4_swar import decode_words, expand_rows, swar_x_order

DEFAULT_TM = 128  # the v5e MXU is 128 x 128
_MAX_FULL_TN = 1024
_MAX_FULL_TK = 3072  # gpt-oss's K = 2880 is no multiple of 128, so it must be one tile
_MAX_TK = 2048
_SCOPED_VMEM_DEFAULT = 16 * 2**20  # v5e's default scoped VMEM limit
_WIDEN_ROWS = 512  # K rows of an 8-bit weight tile widened at a time (a multiple of 128 and 32)
# MXFP4: byte rows decoded at a time (512 K values, 16 scale blocks): a multiple of 128 lanes of
# the lhs halves and of 32 u8 sublanes, and it bounds the f32 / int32 decode temporaries
_FP4_BYTE_ROWS = 256
_FP4_TK_QUANTUM = 1024  # several K tiles: tk / 32 scale rows must fill whole 32-row u8 tiles
FP4_DECODES = ("f32", "swar")  # grouped_matmul_tpu(fp4_decode=...)
# swar: 1.3-1.45x faster than f32 at every gpt-oss-20b expert shape timed on a v5e (T 8-2048,
# benchmarks/moe_gmm_tpu.py, RESULTS.md 2026-12-05 21:30), the same weights bit for bit
FP4_DEFAULT_DECODE = "swar"


def _largest_divisor(dim: int, cap: int, quantum: int) -> int | None:
    """Largest multiple of ``quantum`` <= ``cap`` dividing ``dim``, or None."""
    for t in range(cap - cap % quantum, 0, -quantum):
        if dim % t == 0:
            return t
    return None


def default_tiling(m: int, k: int, n: int, k_quantum: int = 128) -> tuple[int, int, int]:
    """(tm, tk, tn) for the v5e: see the module docstring. ``k_quantum``: what a K tile smaller
    than K must be a multiple of (128; ``_FP4_TK_QUANTUM`` for an MXFP4 rhs)."""
    tm = min(m, DEFAULT_TM)
    tk = k if k <= _MAX_FULL_TK else (_largest_divisor(k, max(_MAX_TK, k_quantum), k_quantum) or k)
    tn = n if n <= _MAX_FULL_TN else (_largest_divisor(n, _MAX_FULL_TN, 128) or 512)
    return tm, tk, tn


def _sublanes(dtype) -> int:
    """Rows of one (sublane, 128-lane) tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _check_tiling(m: int, k: int, n: int, tm: int, tk: int, tn: int, dtype, rhs_dtype, fp4: bool) -> None:
    sub = _sublanes(dtype)
    if not (tm == m or (0 < tm <= m and tm % sub == 0)):
        raise ValueError(f"tm={tm} must be M={m} or a multiple of {sub} <= M")
    if fp4:
        if k % MXFP4_BLOCK or k % tk or not (tk == k or tk % _FP4_TK_QUANTUM == 0):
            raise ValueError(
                f"tk={tk} must divide K={k} (a multiple of {MXFP4_BLOCK}) and be K itself or a "
                f"multiple of {_FP4_TK_QUANTUM} for an MXFP4 rhs"
            )
    elif k % tk or not (tk == k or (tk % 128 == 0 and tk % _sublanes(rhs_dtype) == 0)):
        raise ValueError(f"tk={tk} must divide K={k} and be a multiple of 128 (or K itself)")
    if not (tn == n or (tn % 128 == 0 and 0 < tn)):
        raise ValueError(f"tn={tn} must be N={n} or a multiple of 128")


def visit_schedule(group_sizes: jax.Array, m: int, tm: int, num_visits: int):
    """The visit list for ``group_sizes [G]`` over ``ceil(m / tm)`` row tiles (traceable).

    Returns five int32 arrays of length ``num_visits``: ``out_tile`` (the output row tile),
    ``in_tile`` and ``group`` (the ``lhs`` tile and ``rhs`` group whose blocks to fetch), and
    ``lo``, ``hi`` (global rows ``lo .. hi - 1`` of the output tile come from this visit; empty
    for zero and idle visits), plus the number of real (non-idle) visits as a scalar.
    """
    g = group_sizes.shape[0]
    tiles = -(-m // tm)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    total = ends[-1]
    first = starts // tm
    last = jnp.maximum(ends - 1, 0) // tm
    count = jnp.where(sizes > 0, last - first + 1, 0)  # visits of each group
    group_end = jnp.cumsum(count)  # visit index just past each group's visits
    group_visits = group_end[-1]
    used_tiles = -(-total // tm)  # tiles holding any grouped row
    real = group_visits + (tiles - used_tiles)

    v = jnp.arange(num_visits, dtype=jnp.int32)
    # group of a grouped visit: the first group whose visits end after v (empty groups end where
    # the previous one did, so they are skipped)
    gv = jnp.minimum(jnp.searchsorted(group_end, v, side="right").astype(jnp.int32), g - 1)
    grouped_tile = first[gv] + (v - (group_end[gv] - count[gv]))
    zero_tile = used_tiles + (v - group_visits)  # visits after the grouped ones: tiles past the sum
    is_grouped = v < group_visits
    is_real = v < real
    tile = jnp.where(is_grouped, grouped_tile, zero_tile)
    lo = jnp.where(is_grouped, jnp.maximum(starts[gv], tile * tm), 0)
    hi = jnp.where(is_grouped, jnp.minimum(ends[gv], (tile + 1) * tm), 0)

    # blocks to fetch: a grouped visit's own; otherwise the last grouped visit's (no new DMA)
    last_grouped = jnp.maximum(group_visits - 1, 0)
    fetch_tile = jnp.where(group_visits > 0, grouped_tile[last_grouped], 0)
    fetch_group = jnp.where(group_visits > 0, gv[last_grouped], 0)
    in_tile = jnp.where(is_grouped, tile, fetch_tile)
    group = jnp.where(is_grouped, gv, fetch_group)
    # idle visits (past the real ones) repeat the last real visit's output tile
    out_tile = jnp.where(is_real, tile, jnp.where(real > 0, tile[jnp.maximum(real - 1, 0)], 0))
    return out_tile, in_tile, group, lo, hi, real


def _mxfp4_dot(lhs_even_ref, lhs_odd_ref, packed_ref, scale_ref, acc):
    """``acc [tm, tn]`` f32 plus the K tile's product with the MXFP4 tile (see the docstring).

    ``lhs_even_ref`` / ``lhs_odd_ref`` ``[tm, tk/2]`` (K columns 0, 2, .. and 1, 3, ..),
    ``packed_ref`` u8 ``[tk/2, tn]``, ``scale_ref`` u8 ``[tk/32, tn]`` (e8m0).
    """
    rows, tn = packed_ref.shape
    per_scale = MXFP4_BLOCK // 2  # byte rows under one scale row
    dtype = lhs_even_ref.dtype
    # all the tile's scales at once: tk/32 rows, small, and f32 rows slice on 8-row tiles
    scales = e8m0_bits_decode(scale_ref[...].astype(jnp.int32) & 255)  # [tk/32, tn]
    for lo in range(0, rows, _FP4_BYTE_ROWS):
        hi = min(lo + _FP4_BYTE_ROWS, rows)
        b = packed_ref[lo:hi, :].astype(jnp.int32)
        s = scales[lo // per_scale : hi // per_scale]
        s = jnp.broadcast_to(s[:, None, :], (s.shape[0], per_scale, tn)).reshape(hi - lo, tn)
        w_even = (e2m1_bits_decode(b & 15) * s).astype(dtype)
        w_odd = (e2m1_bits_decode((b >> 4) & 15) * s).astype(dtype)
        acc += jnp.dot(lhs_even_ref[:, lo:hi], w_even, preferred_element_type=jnp.float32)
        acc += jnp.dot(lhs_odd_ref[:, lo:hi], w_odd, preferred_element_type=jnp.float32)
    return acc


def _mxfp4_swar_dot(lhs_ref, packed_ref, scale_ref, acc):
    """``_mxfp4_dot`` with the SWAR decode (quant/fp4_swar.py): ``lhs_ref [4, tm, tk/4]`` (the
    column groups of ``swar_x_order``), the same packed / scale tiles; per chunk of byte rows the
    bytes are read as int32 words (8 codes), decoded two bf16 weights a lane and bitcast, and the
    four column groups' matching lanes multiply them."""
    rows, _ = packed_ref.shape
    dtype = lhs_ref.dtype
    # the tile's scale terms once, one row per word row (4 per scale row: one MXU product), so each
    # chunk slices whole 8-row tiles of them
    s_all = jnp.maximum((scale_ref[...].astype(jnp.int32) & 255) - 1, 0)  # [tk/32, tn]
    s_words = expand_rows(s_all, MXFP4_BLOCK // 8, "dot").astype(jnp.int32) << 7  # [tk/8, tn]
    for lo in range(0, rows, _FP4_BYTE_ROWS):
        hi = min(lo + _FP4_BYTE_ROWS, rows)
        words = pltpu.bitcast(packed_ref[lo:hi, :], jnp.int32)  # [(hi-lo)/4, tn]
        terms = (s_words[lo // 4 : hi // 4],)
        for j, bits in enumerate(decode_words(words, terms, "mx")):
            w = pltpu.bitcast(bits, jnp.bfloat16).astype(dtype)  # [(hi-lo)/2, tn]
            acc += jnp.dot(lhs_ref[j, :, lo // 2 : hi // 2], w, preferred_element_type=jnp.float32)
    return acc


def _gmm_kernel(out_tile_ref, in_tile_ref, group_ref, lo_ref, hi_ref, layer_ref, *refs, tm, nk, rhs_kind):
    """``rhs_kind``: "plain" (refs: lhs, rhs), "channel" (lhs, rhs, per-channel scale) or "mxfp4"
    (lhs even half, odd half, packed, block scales) or "mxfp4_swar" (lhs column groups, packed,
    block scales); then the output and the f32 accumulator."""
    del in_tile_ref, group_ref, layer_ref  # read by the index maps only
    scaled = rhs_kind == "channel"
    if rhs_kind == "mxfp4":
        lhs_even_ref, lhs_odd_ref, rhs_ref, block_scale_ref, out_ref, acc_ref = refs
        scale_ref = None
    elif rhs_kind == "mxfp4_swar":
        lhs_ref, rhs_ref, block_scale_ref, out_ref, acc_ref = refs
        scale_ref = None
    elif scaled:
        lhs_ref, rhs_ref, scale_ref, out_ref, acc_ref = refs
    else:
        lhs_ref, rhs_ref, out_ref, acc_ref = refs
        scale_ref = None
    v = pl.program_id(1)
    kk = pl.program_id(2)
    lo = lo_ref[v]
    hi = hi_ref[v]
    busy = lo < hi

    @pl.when(busy & (kk == 0))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(busy)
    def _accumulate():
        if rhs_kind == "mxfp4":
            acc_ref[...] = _mxfp4_dot(lhs_even_ref, lhs_odd_ref, rhs_ref, block_scale_ref, acc_ref[...])
            return
        if rhs_kind == "mxfp4_swar":
            acc_ref[...] = _mxfp4_swar_dot(lhs_ref, rhs_ref, block_scale_ref, acc_ref[...])
            return
        if rhs_ref.dtype == lhs_ref.dtype:
            acc_ref[...] += jnp.dot(lhs_ref[...], rhs_ref[...], preferred_element_type=jnp.float32)
            return
        # a weight to widen: chunks of K rows, so the widened copy stays small next to the tile
        tk = rhs_ref.shape[0]
        acc = acc_ref[...]
        for lo in range(0, tk, _WIDEN_ROWS):
            hi = min(lo + _WIDEN_ROWS, tk)
            w = rhs_ref[lo:hi, :]
            if jnp.issubdtype(w.dtype, jnp.integer):
                w = w.astype(jnp.float32)  # int8 -> f32 -> bf16 is exact and lowers on every TPU
            w = w.astype(lhs_ref.dtype)
            acc += jnp.dot(lhs_ref[:, lo:hi], w, preferred_element_type=jnp.float32)
        acc_ref[...] = acc

    @pl.when(kk == nk - 1)
    def _store():
        tile = out_tile_ref[v]
        first = (v == 0) | (tile != out_tile_ref[jnp.maximum(v - 1, 0)])
        rows = tile * tm + lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
        mine = (rows >= lo) & (rows < hi)

        def result():
            acc = acc_ref[...]
            return acc * scale_ref[...] if scaled else acc  # [tm, tn] * [1, tn]

        @pl.when(first & busy)
        def _first():
            out_ref[...] = jnp.where(mine, result(), 0.0).astype(out_ref.dtype)

        @pl.when(first & ~busy)
        def _zeros():
            out_ref[...] = jnp.zeros_like(out_ref)

        @pl.when(~first & busy)
        def _merge():
            # the select in f32 (exact for a bf16 output): the v5e's VPU has no bf16
            kept = out_ref[...].astype(jnp.float32)
            out_ref[...] = jnp.where(mine, result(), kept).astype(out_ref.dtype)


def _vmem_limit(
    tm: int, tk: int, tn: int, in_bytes: int, w_bytes: float, out_bytes: int, temp_bytes: int = 0
) -> int | None:
    """A scoped VMEM limit when double-buffered tiles (plus ``temp_bytes`` of in-kernel
    temporaries) outgrow the default; None keeps it."""
    need = 2 * (tm * tk * in_bytes + tk * tn * w_bytes + tm * tn * out_bytes) + tm * tn * 4 + temp_bytes
    need = int(need * 1.25) + 2**20
    return None if need <= _SCOPED_VMEM_DEFAULT else min(need, 100 * 2**20)


@functools.partial(jax.jit, static_argnames=("tiling", "fp4_decode", "interpret"))
def grouped_matmul_tpu(
    lhs: jax.Array,
    rhs: jax.Array | Mxfp4Weight,
    group_sizes: jax.Array,
    rhs_scale: jax.Array | None = None,
    layer: jax.Array | None = None,
    *,
    tiling: tuple[int, int, int] | None = None,
    fp4_decode: str | None = None,
    interpret=None,
) -> jax.Array:
    """``lhs [M, K]``, ``rhs [G, K, N]``, ``group_sizes [G]`` int32 -> ``[M, N]`` in lhs.dtype.

    ``rhs_scale``: f32 ``[G, 1, N]`` per-output-channel scales of an int8 / float8_e4m3fn ``rhs``
    (dequantized weight = ``rhs * rhs_scale``), or None for a plain ``rhs``. ``rhs`` may instead
    be an ``Mxfp4Weight`` (``rhs_scale`` None): ``packed`` u8 ``[G, K/2, N]`` and e8m0 ``scale``
    u8 ``[G, K/32, N]``, weight ``dequantize_mxfp4(rhs)``, decoded in VMEM (module docstring); it
    must not be ``rotated`` (that needs ``lhs`` rotated, which is the caller's business).
    ``layer``: a scalar int32 when ``rhs`` is every layer's experts stacked, ``[L, G, K, N]``
    (scales ``[L, G, 1, N]``; MXFP4 ``[L, G, K/2, N]`` and ``[L, G, K/32, N]``): the kernel
    fetches layer ``layer``'s blocks itself. A layer scan that sliced the stack instead would hand
    the custom call a copy of the whole layer's experts (all G of them, every step), where the
    kernel reads only the groups that have rows. ``tiling``: (tm, tk, tn), default
    ``default_tiling(M, K, N)``. ``fp4_decode``: an MXFP4 rhs's decode, one of ``FP4_DECODES``
    (None: ``FP4_DEFAULT_DECODE``): "f32" (module docstring) or "swar" (quant/fp4_swar.py: two
    bf16 weights per 32-bit lane, the same weights bit for bit). ``interpret``: None compiles for
    TPU; a ``pltpu.InterpretParams`` runs the kernel in TPU interpret mode.
    """
    fp4_decode = fp4_decode or FP4_DEFAULT_DECODE
    if fp4_decode not in FP4_DECODES:
        raise ValueError(f"grouped_matmul_tpu: fp4_decode={fp4_decode!r}, not one of {FP4_DECODES}")
    stacked = layer is not None
    fp4 = isinstance(rhs, Mxfp4Weight)
    lead_dims = 2 if stacked else 1
    if isinstance(rhs, Mxfp4Weight):  # fp4, tested so mypy narrows rhs
        if rhs_scale is not None or rhs.rotated or rhs.k_tile:
            raise ValueError(
                "grouped_matmul_tpu: an MXFP4 rhs carries its own scales and must be in natural K "
                "order, not rotated"
            )
        if rhs.packed.ndim != lead_dims + 2 or rhs.scale.shape != (
            *rhs.packed.shape[:-2],
            rhs.packed.shape[-2] * 2 // MXFP4_BLOCK,
            rhs.packed.shape[-1],
        ):
            raise ValueError(
                f"grouped_matmul_tpu: MXFP4 packed {rhs.packed.shape} / scale {rhs.scale.shape} do not fit "
                f"{'[L, G, K/2, N] / [L, G, K/32, N]' if stacked else '[G, K/2, N] / [G, K/32, N]'}"
            )
        # the unpacked shape, as the plain path sees it
        rhs_shape = (*rhs.packed.shape[:-2], rhs.in_features, rhs.out_features)
        rhs_dtype = jnp.dtype(jnp.uint8)
    else:
        rhs_shape, rhs_dtype = rhs.shape, rhs.dtype
    per_layer = rhs_shape[1:] if stacked else rhs_shape
    if (
        lhs.ndim != 2
        or len(per_layer) != 3
        or per_layer[1] != lhs.shape[1]
        or group_sizes.shape != per_layer[:1]
    ):
        raise ValueError(
            f"grouped_matmul_tpu: lhs {lhs.shape}, rhs {rhs_shape}, group_sizes {group_sizes.shape} "
            f"do not fit [M, K], {'[L, G, K, N]' if stacked else '[G, K, N]'}, [G]"
        )
    m, k = lhs.shape
    g, _, n = per_layer
    scaled = rhs_scale is not None
    want_scale = (rhs_shape[0], g, 1, n) if stacked else (g, 1, n)
    if rhs_scale is not None and rhs_scale.shape != want_scale:
        raise ValueError(f"grouped_matmul_tpu: rhs_scale {rhs_scale.shape} is not {want_scale}")
    tm, tk, tn = tiling or default_tiling(m, k, n, _FP4_TK_QUANTUM if fp4 else 128)
    _check_tiling(m, k, n, tm, tk, tn, lhs.dtype, rhs_dtype, fp4)
    nk = k // tk
    tiles_m = -(-m // tm)
    tiles_n = -(-n // tn)
    num_visits = tiles_m + min(g, m) - 1
    schedule = visit_schedule(group_sizes, m, tm, num_visits)
    out_tile, in_tile, group, lo, hi, _ = schedule

    # Index maps get the grid indices, then the scalar-prefetch refs: the schedule's five arrays
    # and the layer ([1] i32; 0 and unused for an unstacked rhs).
    def lhs_map(j, v, kk, out_tile, in_tile, group, lo, hi, lyr):
        busy = lo[v] < hi[v]
        return in_tile[v], jnp.where(busy, kk, nk - 1)

    def rhs_map(j, v, kk, out_tile, in_tile, group, lo, hi, lyr):
        busy = lo[v] < hi[v]
        block = (group[v], jnp.where(busy, kk, nk - 1), j)
        return (lyr[0], *block) if stacked else block

    def scale_map(j, v, kk, out_tile, in_tile, group, lo, hi, lyr):
        return (lyr[0], group[v], 0, j) if stacked else (group[v], 0, j)

    def out_map(j, v, kk, out_tile, in_tile, group, lo, hi, lyr):
        return out_tile[v], j

    lead = (None, None) if stacked else (None,)
    if isinstance(rhs, Mxfp4Weight) and fp4_decode == "swar":
        # lhs's K columns in the decoded rows' order (one pass over [M, K], fused by XLA)
        in_specs = [
            pl.BlockSpec((4, tm, tk // 4), lambda *a: (0, *lhs_map(*a))),
            pl.BlockSpec((*lead, tk // 2, tn), rhs_map),
            pl.BlockSpec((*lead, tk // MXFP4_BLOCK, tn), rhs_map),
        ]
        operands = [
            swar_x_order(lhs),
            rhs.packed,
            rhs.scale,
        ]
        w_bytes = 0.5 + 1 / MXFP4_BLOCK
        # per chunk of byte rows: int32 words and ~8 word-sized temporaries (a byte each per byte
        # row), four bf16 outputs of half the rows (a byte each)
        temp_bytes = _FP4_BYTE_ROWS * tn * 12
    elif isinstance(rhs, Mxfp4Weight):  # fp4
        # even / odd K columns of lhs (one pass over [M, K], fused by XLA); the u8 bytes and scales
        # as they are (see the module docstring)
        halves = lhs.reshape(m, k // 2, 2)
        in_specs = [
            pl.BlockSpec((tm, tk // 2), lhs_map),
            pl.BlockSpec((tm, tk // 2), lhs_map),
            pl.BlockSpec((*lead, tk // 2, tn), rhs_map),  # same block index as K/2 byte rows
            pl.BlockSpec((*lead, tk // MXFP4_BLOCK, tn), rhs_map),
        ]
        operands = [
            halves[..., 0],
            halves[..., 1],
            rhs.packed,
            rhs.scale,
        ]
        w_bytes = 0.5 + 1 / MXFP4_BLOCK
        # per chunk: int32 bytes, f32 codes / scales / products, two weights in lhs.dtype
        temp_bytes = _FP4_BYTE_ROWS * tn * (6 * 4 + 2 * lhs.dtype.itemsize)
    else:
        in_specs = [pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((*lead, tk, tn), rhs_map)]
        operands = [lhs, rhs]
        if rhs_scale is not None:
            in_specs.append(pl.BlockSpec((*lead, 1, tn), scale_map))
            operands.append(rhs_scale.astype(jnp.float32))
        w_bytes, temp_bytes = rhs_dtype.itemsize, 0
    layer_ref = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))

    vmem = _vmem_limit(tm, tk, tn, lhs.dtype.itemsize, w_bytes, lhs.dtype.itemsize, temp_bytes)
    # bytes, with one K tile (the default): each N tile reads lhs once and each visited group's
    # rhs once (consecutive visits share blocks); with several, every visit re-reads both
    visits_read = tiles_m if nk == 1 else num_visits
    groups_read = min(num_visits, g) if nk == 1 else num_visits
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=tiles_n * visits_read * tm * k * lhs.dtype.itemsize
        + int(groups_read * k * n * w_bytes)
        + m * n * lhs.dtype.itemsize,
    )
    rhs_kind = (
        ("mxfp4_swar" if fp4_decode == "swar" else "mxfp4") if fp4 else "channel" if scaled else "plain"
    )
    return pl.pallas_call(
        functools.partial(_gmm_kernel, tm=tm, nk=nk, rhs_kind=rhs_kind),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(tiles_n, num_visits, nk),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"), vmem_limit_bytes=vmem
        ),
        cost_estimate=cost,
        interpret=interpret if interpret is not None else False,
    )(out_tile, in_tile, group, lo, hi, layer_ref, *operands)

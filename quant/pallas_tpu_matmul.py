"""Pallas TPU quantized matmuls: FP8 W8A16 / W8A8 and FP4 (MXFP4, NVFP4) W4A16.

Every kernel computes ``x [M, K] @ W [K, N] -> [M, N]`` for a record of ``quant/`` and has its pure
jnp reference beside it (``*_ref``: the format's exact dequant, then an f32 GEMM at HIGHEST
precision). Tests run the kernels in TPU interpret mode with race detection against the references.

Grid and tiles
--------------
grid = (M/tm, N/tn, K/tk), semantics ("parallel", "parallel", "arbitrary"): an f32 ``[tm, tn]``
VMEM accumulator is zeroed at k == 0 and written out (cast to the output dtype) at the last k.
Tiles are full array dims or multiples of 128 lanes (N) so every block obeys the (8, 128) rule;
M is padded up to the row tile. The weight is read once per M tile: for decode (M <= tm) that is
exactly once, which is what the kernels are for (memory-bound GEMV: bytes/element 1 for FP8,
0.5 + 1/32 or 1/16 for FP4).

Scales
------
Scales travel as a full-K block ``[K/bk, tn]`` (small: 1/bk of the weight's rows) whose rows for
the current K tile are read with a dynamic sublane slice, so their block shape is always legal.

* FP8: the record's ``scale [Kb, Nb]`` is expanded along N only (to ``[Kb, N]``, once per call,
  outside the kernel). Inside, each K sub-block of ``bk`` rows of the tile gets its own partial
  dot, multiplied by its scale row: ``acc += (x[:, blk] @ q[blk]) * s[row]``. Per-channel and
  per-tensor records have one scale row (bk = K) and so one dot per tile; blocks of 128 take
  ``tk / 128`` dots. W8A16 upcasts the fp8 tile to the activation dtype in VMEM; W8A8 quantizes
  ``x`` per token outside the kernel (an M x K elementwise pass XLA fuses), feeds an fp8 x fp8 dot
  with f32 accumulation, and multiplies the per-token scale in at the end.
* FP4: bytes stay packed in HBM and VMEM. ``x`` is split (outside, once) into its even and odd K
  columns: even k pair with the low nibbles, odd k with the high nibbles, so the kernel never
  interleaves rows. Nibbles and scale bytes are decoded with integer ops and a bitcast
  (``codecs.e2m1_bits_decode``, ``e8m0_bits_decode``, ``e4m3_bits_decode``): no gathers and no
  fp4/fp8 dtypes in VMEM (older TPUs cannot convert them). Scale rows are broadcast over the
  ``block/2`` byte rows they cover, multiplied in f32, cast to the activation dtype, and two half-K
  dots accumulate in f32. NVFP4's global scale does not vary along K (one per tensor, or per column
  after fusing tensors), so it multiplies the output after the kernel (1/global for the
  compressed-tensors convention).
* FP4 decodes (``decode=``, ``FP4_DECODES``; all give the same weights bit for bit, so results
  differ only by f32 accumulation order). On a v5e the "f32" decode above made the kernel
  VPU-bound (~20 ops a weight: 18-20% of the roofline of its bytes, slower than bf16):
  "int" keeps one code per lane but builds the f32 bits with an integer add, the MX scale folded
  into it (``fp4_swar.lane_decode``, ~10 ops + the bf16 convert); "swar" / "swar_bcast" read the
  bytes as int32 words of 8 codes and emit two finished bf16 weights per lane, bitcast for free
  (``quant/fp4_swar.py``, ~5.5 ops a weight MX, ~8 NVFP4), against x's K columns permuted once
  outside to the decoded row order, 4 dots a tile; the two differ in how a scale row is repeated
  over the 4 (MX) or 2 (NVFP4) word rows it covers: an MXU product with a 0/1 matrix, or a
  broadcast + sub-tile reshape.
* Records in the tiled K order (``k_tile``, ``fp4.tile_k_order``; ``quant/fp4_swar.py``): the SWAR
  decode reads x in natural order, each output its own quarter of the tile's scale rows, so the
  column permutation XLA otherwise runs before every matmul goes away. Compiled and exact on a
  v5e (stage ``fp4-tiled``, 2026-12-07): faster for MXFP4, slower for NVFP4, so a TPU runner
  tiles the record types in ``TILE_RECORDS_FOR_KERNEL`` (MXFP4) at start-up.

Status: verified in TPU interpret mode on CPU (tests/quant/test_pallas_tpu_matmul.py, and the
decodes alone bit for bit in tests/quant/test_fp4_swar.py). Every kernel and decode is compiled by
Mosaic and checked against its reference on a v5e (benchmarks/RESULTS.md, "Quantized matmuls on a
TPU v5e" and the 2026-12-05 17:55 run): the 1B shape's 16-layer scan at M 1 / 8, MXFP4 f32 / int /
swar / swar_bcast 3215 / 2366 / 1530 / 2076 us, NVFP4 3759 / 3055 / 2336 / 5554 us (bf16 2677 us),
so "swar" is the default for both. FP8 is the default's only scoped-VMEM risk: ``_VMEM_LIMIT``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuserve.quant.codecs import e2m1_bits_decode, e4m3_bits_decode, e8m0_bits_decode
from tpuserve.quant.fp4 import Mxfp4Weight, Nvfp4Weight, dequantize_mxfp4, dequantize_nvfp4, tile_k_order
from tpuserve.quant.fp4_swar import (
    decode_words,
    expand_rows,
    lane_decode,
    nv_scale_terms,
    output_flip,
    swar_x_order,
)
from tpuserve.quant.fp8 import Fp8Weight, dequantize_fp8, quantize_per_token, scale_columns

_MAX_TK = 2048  # K rows per tile (fp8: 2 MiB of weight per 1024-lane tile)
_MAX_TN = 512
# FP4 row tiles of at most _FP4_WIDE_TM rows take N tiles up to 1024 wide (half as many grid
# steps, each with its fixed cost). On a v5e (benchmarks/RESULTS.md, 2026-12-07) the 8B shape's
# four MXFP4 matmuls at M 1 ran 2392 / 2316 / 2355 us at <= 512 / 1024 / 2048, the 1B shape's at
# M 128 2284 / 2199 / 2240 us, NVFP4 even at M 1 and 2% faster at 128. Larger row tiles (prefill)
# keep 512: not measured wider.
_MAX_TN_FP4 = 1024
_FP4_WIDE_TM = 128
_MAX_TM = 256
_U8_TILE_ROWS = 32  # sublanes of an 8-bit VMEM tile: dynamic u8 row slices must start at multiples


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _pick_tile(dim: int, pref: int, quantum: int) -> int:
    """Largest multiple of ``quantum`` <= ``pref`` dividing ``dim``; the full dim if none (or small)."""
    if dim <= pref:
        return dim
    for t in range(pref - pref % quantum, 0, -quantum):
        if dim % t == 0:
            return t
    return dim


def _row_tile(m: int, x_dtype, block_m: int | None) -> int:
    sub = 8 * max(1, 4 // jnp.dtype(x_dtype).itemsize)  # sublanes per tile: 8 f32, 16 bf16, 32 fp8
    return block_m or min(_MAX_TM, _round_up(m, sub))


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    return a if a.shape[0] == rows else jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


# Scoped VMEM the kernels may use. Mosaic's default is 16 MiB; the Llama-8B shape's down
# projection (K 14336, per-channel scales) asked for 17.3 MB at 128 rows and 22 MB at 256 on a v5e
# even with the upcast split (_MAX_SUB_ROWS), and the FP4 kernels' 1024-wide N tiles asked for
# 18 MB (NVFP4, K 8192). Every TPU since v4 has >= 64 MiB of VMEM per core.
_VMEM_LIMIT = 48 * 1024 * 1024


def _compiler_params(vmem_limit_bytes: int | None = None):
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
    )


def _layer_operand(name: str, weight: jax.Array, layer) -> tuple[int, jax.Array]:
    """How many leading layer axes ``weight`` has (0 or 1) and the layer index as i32 [1].

    A layer scan that slices a stacked weight hands the Pallas call a slice XLA materializes: every
    layer's weight is copied out of the stack on every step (read + write + the kernel's read, ~3x
    the bytes of a GEMV that should read them once). Passing the stack whole with ``layer`` lets the
    kernel's index maps pick the layer's blocks in place (scalar prefetch).
    """
    if layer is None:
        if weight.ndim != 2:
            raise ValueError(f"{name}: a stacked weight {weight.shape} needs the layer to read")
        return 0, jnp.zeros((1,), jnp.int32)
    if weight.ndim != 3:
        raise ValueError(f"{name}: layer given, but the weight {weight.shape} is not stacked [L, K, N]")
    return 1, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


def _spec(stacked: int, block: tuple[int, int], index):
    """A BlockSpec over a weight-side operand ``[*L, rows, cols]``: the layer axis (when present)
    is squeezed and indexed by the prefetched layer; ``index(i, j, kk)`` gives the 2-D block."""
    if not stacked:
        return pl.BlockSpec(block, lambda i, j, kk, layer: index(i, j, kk))
    return pl.BlockSpec((None, *block), lambda i, j, kk, layer: (layer[0], *index(i, j, kk)))


def _act_spec(block: tuple[int, int], index):
    return pl.BlockSpec(block, lambda i, j, kk, layer: index(i, j, kk))


# ---------------------------------------------------------------------------------------------
# FP8


# K rows one partial dot of the FP8 kernel upcasts at a time. Mosaic keeps the upcast tile (and,
# on chips without fp8 support, its widened intermediates) in scoped VMEM: a whole [2048, 512]
# per-channel tile beside a 256-row x block needed 22 MB on a v5e, over the 16 MB default
# (the Llama-8B shape's prefill, benchmarks/results/tpu-v5e-2026-12-05d/e2e-8b-fp8.log).
_MAX_SUB_ROWS = 512


def _split_subs(subs: tuple[tuple[int, int, int], ...]) -> tuple[tuple[int, int, int], ...]:
    """Cut every (lo, hi, scale row) sub-block longer than ``_MAX_SUB_ROWS`` into pieces that
    share its scale row, so the DMA tile stays large while each upcast stays small."""
    out = []
    for lo, hi, j in subs:
        for a in range(lo, hi, _MAX_SUB_ROWS):
            out.append((a, min(a + _MAX_SUB_ROWS, hi), j))
    return tuple(out)


def _fp8_kernel(layer_ref, *refs, subs, rows_per_tile, tk, bk, act_quant, nk):
    del layer_ref  # read by the index maps only
    if act_quant:
        x_ref, q_ref, s_ref, sx_ref, o_ref, acc_ref = refs
    else:
        x_ref, q_ref, s_ref, o_ref, acc_ref = refs
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    acc = acc_ref[...]
    for lo, hi, j in subs:
        # scale row of this sub-block: several rows per tile (tk >= bk) or one row per bk / tk tiles
        row = kk * rows_per_tile + j if rows_per_tile else (kk * tk) // bk
        q = q_ref[lo:hi, :]  # read (and upcast) one sub-block at a time: _MAX_SUB_ROWS says why
        if not act_quant:
            q = q.astype(x.dtype)  # exact: every e4m3 value is a bf16 / f32 value
        part = jnp.dot(x[:, lo:hi], q, preferred_element_type=jnp.float32)
        acc = acc + part * s_ref[pl.ds(row, 1), :]
    acc_ref[...] = acc

    @pl.when(kk == nk - 1)
    def _store():
        y = acc_ref[...]
        if act_quant:
            y = y * sx_ref[...]
        o_ref[...] = y.astype(o_ref.dtype)


def fp8_matmul_tpu(
    x: jax.Array,
    w: Fp8Weight,
    *,
    out_dtype=None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    layer=None,
    interpret=None,
) -> jax.Array:
    """``x [M, K] @ w -> [M, N]`` (W8A16, or W8A8 when ``w.act_quant``), f32 accumulation.

    w: a record of ``[K, N]``, or of ``[L, K, N]`` with ``layer`` (an i32 scalar, traced or not)
    naming the layer to multiply by, read in place (``_layer_operand`` says why).
    block_k must divide K and be a multiple of the record's K block (or divide it), unless it is
    K itself. ``interpret``: None compiles for TPU; a ``pltpu.InterpretParams`` runs interpreted.
    """
    m, k = x.shape
    n = w.out_features
    stacked, layer_arr = _layer_operand("fp8_matmul_tpu", w.qweight, layer)
    if w.in_features != k:
        raise ValueError(f"fp8_matmul_tpu: x {x.shape} does not fit the weight {w.qweight.shape}")
    out_dtype = out_dtype or x.dtype
    bk = min(w.block[0], k)
    tk = block_k or (k if k <= _MAX_TK else _pick_tile(k, _MAX_TK, math.lcm(bk, 128)))
    if k % tk or not (tk == k or tk % bk == 0 or bk % tk == 0):
        raise ValueError(f"block_k={tk} must divide K={k} and align with the scale block {bk}")
    if tk >= bk:
        nsub = -(-tk // bk)
        subs = tuple((j * bk, min((j + 1) * bk, tk), j) for j in range(nsub))
        rows_per_tile = nsub
    else:
        subs, rows_per_tile = ((0, tk, 0),), 0
    subs = _split_subs(subs)
    s_cols = scale_columns(w)  # [*L, Kb, N]
    kb = s_cols.shape[-2]

    if w.act_quant:
        xin, sx = quantize_per_token(x)
    else:
        xin, sx = x, None
    tm = _row_tile(m, xin.dtype, block_m)
    mp = _round_up(m, tm)
    tn = block_n or _pick_tile(n, _MAX_TN, 128)
    nk = k // tk

    in_specs = [
        _act_spec((tm, tk), lambda i, j, kk: (i, kk)),
        _spec(stacked, (tk, tn), lambda i, j, kk: (kk, j)),
        _spec(stacked, (kb, tn), lambda i, j, kk: (0, j)),
    ]
    args = [_pad_rows(xin, mp), w.qweight, s_cols]
    if w.act_quant:
        in_specs.append(_act_spec((tm, 1), lambda i, j, kk: (i, 0)))
        assert sx is not None  # quantize_per_token gave it with xin
        args.append(_pad_rows(sx, mp))
    kernel = functools.partial(
        _fp8_kernel, subs=subs, rows_per_tile=rows_per_tile, tk=tk, bk=bk, act_quant=w.act_quant, nk=nk
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(mp // tm, n // tn, nk),
            in_specs=in_specs,
            out_specs=_act_spec((tm, tn), lambda i, j, kk: (i, j)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        compiler_params=_compiler_params(_VMEM_LIMIT),
        interpret=interpret if interpret is not None else False,
    )(layer_arr, *args)
    return out[:m]


def fp8_matmul_ref(x: jax.Array, w: Fp8Weight, *, out_dtype=None, layer=None) -> jax.Array:
    """Reference for ``fp8_matmul_tpu``: exact dequant (and the same per-token activation quant)."""
    if layer is not None:
        w = layer_of(w, layer)
    k, n = w.in_features, w.out_features
    if w.act_quant:
        xq, sx = quantize_per_token(x)
        xf = xq.astype(jnp.float32) * sx
    else:
        xf = x.astype(jnp.float32)
    y = jnp.dot(xf, dequantize_fp8(w).reshape(k, n), precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)


# ---------------------------------------------------------------------------------------------
# FP4


def _fp4_kernel(
    layer_ref, xe_ref, xo_ref, p_ref, s_ref, o_ref, acc_ref, *, scale_rows, block, kind, nk, by_int
):
    """One code per 32-bit lane. by_int False (decode "f32"): ``e2m1_bits_decode`` times the f32
    scale; True (decode "int"): ``fp4_swar.lane_decode``, the MX scale folded into its integer add
    (NVFP4 still multiplies by its e4m3 scale in f32)."""
    del layer_ref  # read by the index maps only
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    b = p_ref[...].astype(jnp.int32)  # [tk/2, tn]
    sb = s_ref[pl.ds(kk * scale_rows, scale_rows), :]  # [tk/block, tn]
    if by_int and kind == "mx":
        s = jnp.maximum(sb.astype(jnp.int32) - 1, 0) << 23  # the integer add's exponent bias
    else:
        s = e8m0_bits_decode(sb) if kind == "mx" else e4m3_bits_decode(sb)
    tn = s.shape[-1]
    # each scale row covers block/2 byte rows: broadcast along a new axis, merge it into the rows
    s = jnp.broadcast_to(s[:, None, :], (scale_rows, block // 2, tn)).reshape(-1, tn)
    xe = xe_ref[...]
    if by_int and kind == "mx":
        w_even = lane_decode(b, 0, s).astype(xe.dtype)
        w_odd = lane_decode(b, 1, s).astype(xe.dtype)
    elif by_int:
        w_even = (lane_decode(b, 0, 126 << 23) * s).astype(xe.dtype)
        w_odd = (lane_decode(b, 1, 126 << 23) * s).astype(xe.dtype)
    else:
        w_even = (e2m1_bits_decode(b & 15) * s).astype(xe.dtype)
        w_odd = (e2m1_bits_decode(b >> 4) * s).astype(xe.dtype)
    acc_ref[...] += jnp.dot(xe, w_even, preferred_element_type=jnp.float32) + jnp.dot(
        xo_ref[...], w_odd, preferred_element_type=jnp.float32
    )

    @pl.when(kk == nk - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _fp4_swar_kernel(layer_ref, x_ref, p_ref, s_ref, o_ref, acc_ref, *, scale_rows, block, kind, nk, expand):
    """The SWAR decode (quant/fp4_swar.py): the tile's bytes as int32 words ``[tk/8, tn]`` (8 codes
    each, k = 8i + c), four bf16 outputs per word row, four dots against x's matching column groups
    (``swar_x_order``). The scale terms are repeated over the block/8 word rows each scale row
    covers (``fp4_swar.expand_rows``; by the MXU, a -0.0 NVFP4 scale turns +0.0, so its block's
    zero codes lose their sign: a zero scale is out of the decode's domain anyway)."""
    del layer_ref  # read by the index maps only
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    sb = s_ref[pl.ds(kk * scale_rows, scale_rows), :].astype(jnp.int32)  # [tk/block, tn]
    per_scale = block // 8  # word rows under one scale row
    if kind == "mx":
        s_rows = expand_rows(jnp.maximum(sb - 1, 0), per_scale, expand).astype(jnp.int32)
        terms: tuple[jax.Array, ...] = (s_rows << 7,)
    elif expand == "bcast":  # the terms per scale row, then repeated: ~1.4 ops a weight fewer
        terms = tuple(expand_rows(t, per_scale, expand) for t in nv_scale_terms(e4m3_bits_decode(sb)))
    else:  # the MXU repeats only values exact in bf16: the scale itself, then the terms per word
        terms = nv_scale_terms(expand_rows(e4m3_bits_decode(sb), per_scale, expand))
    words = pltpu.bitcast(p_ref[...], jnp.int32)  # [tk/8, tn]: byte rows 4i..4i+3 in word row i
    acc = acc_ref[...]
    for j, bits in enumerate(decode_words(words, terms, kind)):
        w = pltpu.bitcast(bits, jnp.bfloat16)  # [tk/4, tn]: row 2i + h is k = 8i + j + 4h
        xj = x_ref[j]
        acc = acc + jnp.dot(xj, w.astype(xj.dtype), preferred_element_type=jnp.float32)
    acc_ref[...] = acc

    @pl.when(kk == nk - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _fp4_swar_tiled_kernel(layer_ref, x_ref, p_ref, s_ref, o_ref, acc_ref, *, tk, block, kind, nk):
    """The SWAR decode of a record in the tiled K order (``quant/fp4_swar.py``): output ``j`` of a
    word row is x's natural columns ``[j * tk/4, (j+1) * tk/4)`` of the tile, so x arrives as it is;
    each output reads its own quarter of the tile's scale rows, each row broadcast over the
    ``block / 2`` word rows it covers (whole 8-row sublane tiles)."""
    del layer_ref  # read by the index maps only
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    scale_rows = tk // block
    sb = s_ref[pl.ds(kk * scale_rows, scale_rows), :].astype(jnp.int32)  # [tk/block, tn]
    if kind == "mx":
        terms: tuple[jax.Array, ...] = (jnp.maximum(sb - 1, 0) << 7,)
    else:
        a, d, flip = nv_scale_terms(e4m3_bits_decode(sb))
        terms = (a, d, output_flip(flip))
    per_output, rep = scale_rows // 4, block // 2
    tn = sb.shape[1]

    def rows(v, j):  # output j's scale rows, each repeated over its word rows: [tk/8, tn]
        v = v[j * per_output : (j + 1) * per_output]
        return jnp.broadcast_to(v[:, None, :], (per_output, rep, tn)).reshape(per_output * rep, tn)

    output_terms = [tuple(rows(t, j) for t in terms) for j in range(4)]
    words = pltpu.bitcast(p_ref[...], jnp.int32)  # [tk/8, tn]
    q = tk // 4
    acc = acc_ref[...]
    for j, bits in enumerate(decode_words(words, None, kind, output_terms)):
        w = pltpu.bitcast(bits, jnp.bfloat16)  # [tk/4, tn]: row r is element j * tk/4 + r
        xj = x_ref[:, j * q : (j + 1) * q]
        acc = acc + jnp.dot(xj, w.astype(xj.dtype), preferred_element_type=jnp.float32)
    acc_ref[...] = acc

    @pl.when(kk == nk - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


# decode= of fp4_matmul_tpu: "f32" (one code per lane, f32 scale multiply, even/odd x halves),
# "int" (one code per lane by an integer add, the MX scale folded in: fp4_swar.lane_decode),
# "swar" (quant/fp4_swar.py, scale rows repeated by an MXU product), "swar_bcast" (the same, rows
# repeated by a broadcast + reshape). All give the same dequantized weights bit for bit.
FP4_DECODES = ("f32", "int", "swar", "swar_bcast")
FP4_DEFAULT_DECODE = "swar"  # what decode=None means: the fastest on a v5e (module docstring)


def fp4_k_tile(k: int, blk: int, swar: bool, block_k: int | None = None, compiled: bool = True) -> int:
    """The FP4 kernels' K tile (``block_k``, or the default for K) for scale block ``blk``.

    SWAR: x's four column groups take tk/4 lanes a tile, so tk a multiple of 512 keeps them whole.
    The full-K scale block is sliced at kk * tk/blk rows, and Mosaic must prove a dynamic u8 slice
    aligned to its 32-row tile: with several K tiles, tk/blk a multiple of 32 (on a v5e the 8B
    shape's down projection, K 14336, took tk 3584 = 112 scale rows and did not compile).
    Interpret mode has no such rule (tests take small tiles to cover several K tiles)."""
    quantum = math.lcm(512 if swar else 256, _U8_TILE_ROWS * blk)
    tk = block_k or (k if k <= 2 * _MAX_TK else _pick_tile(k, 2 * _MAX_TK, quantum))
    if k % tk or tk % blk or tk % 8:
        raise ValueError(f"block_k={tk} must divide K={k} and be a multiple of {blk}")
    if compiled and tk < k and (tk // blk) % _U8_TILE_ROWS:
        raise ValueError(
            f"block_k={tk}: with several K tiles a compiled kernel needs block_k / {blk} (scale rows "
            f"a tile) to be a multiple of {_U8_TILE_ROWS}, the u8 sublane tile"
        )
    return tk


# The FP4 record types a TPU engine holds in the tiled K order (``tile_records_for_kernel``). On a
# v5e (2026-12-07, stage fp4-tiled, exact) tiled MXFP4 ran 1.12x the plain SWAR decode at the 1B
# shape (1348 vs 1507 us) and 1.09x at the 8B (2136 vs 2320 us); tiled NVFP4 ran 0.81x (2862 vs
# 2328 us; why is not traced yet), so NVFP4 stays plain.
TILE_RECORDS_FOR_KERNEL: tuple[type, ...] = (Mxfp4Weight,)


def tile_records_for_kernel(tree, lane_quantum: int = 512):
    """``tree`` with each dense FP4 record the kernel takes (``[K/2, N]``, or stacked ``[L, K/2, N]``)
    in the tiled K order of its default K tile, where that tile is a multiple of ``lane_quantum``
    (compiled: 512, x's four column groups in whole 128-lane tiles). Stacks are tiled one layer at
    a time (a whole stack's int32 codes can outgrow the device), once, at start-up; other leaves,
    expert stacks, already tiled records and types not in ``TILE_RECORDS_FOR_KERNEL`` are returned
    as they are."""

    def one(w):
        if not isinstance(w, TILE_RECORDS_FOR_KERNEL) or w.k_tile or w.packed.ndim not in (2, 3):
            return w
        tk = fp4_k_tile(w.in_features, w.block, True)
        if tk % lane_quantum or tk % (4 * w.block):
            return w
        tile = jax.jit(lambda r: tile_k_order(r, tk))
        if w.packed.ndim == 2:
            return tile(w)
        layers = [tile(jax.tree.map(lambda a, i=i: a[i], w)) for i in range(w.packed.shape[0])]
        return jax.tree.map(lambda *a: jnp.stack(a), *layers)

    return jax.tree.map(one, tree, is_leaf=lambda a: isinstance(a, (Mxfp4Weight, Nvfp4Weight)))


def fp4_n_tile(n: int, tm: int, block_n: int | None = None) -> int:
    """The FP4 kernels' N tile (``block_n``, or the default for N and the row tile ``tm``)."""
    return block_n or _pick_tile(n, _MAX_TN_FP4 if tm <= _FP4_WIDE_TM else _MAX_TN, 128)


def fp4_matmul_tpu(
    x: jax.Array,
    w: Mxfp4Weight | Nvfp4Weight,
    *,
    out_dtype=None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    layer=None,
    decode: str | None = None,
    interpret=None,
) -> jax.Array:
    """``x [M, K] @ w -> [M, N]`` for MXFP4 / NVFP4 (W4A16), f32 accumulation.

    w: a record of ``[K, N]``, or of ``[L, K, N]`` with ``layer`` (as in ``fp8_matmul_tpu``).
    block_k (in elements of K) must divide K and be a multiple of the format's block (and of 8;
    on a TPU the SWAR decodes want it a multiple of 512, or K).
    decode: one of ``FP4_DECODES`` (None: ``FP4_DEFAULT_DECODE``): how the kernel turns codes
    into weights.
    """
    m, k = x.shape
    n = w.out_features
    stacked, layer_arr = _layer_operand("fp4_matmul_tpu", w.packed, layer)
    if w.in_features != k:
        raise ValueError(f"fp4_matmul_tpu: x {x.shape} does not fit the weight {w.packed.shape}")
    if getattr(w, "rotated", False):
        raise ValueError(
            "fp4_matmul_tpu: a rotated MXFP4 record needs x rotated first "
            "(quant.dispatch.quant_linear does both)"
        )
    decode = decode or FP4_DEFAULT_DECODE
    if decode not in FP4_DECODES:
        raise ValueError(f"fp4_matmul_tpu: decode={decode!r}, not one of {FP4_DECODES}")
    swar = decode.startswith("swar")
    out_dtype = out_dtype or x.dtype
    blk = w.block
    if w.k_tile:  # codes in the tiled K order: the tile is the record's, and the decode SWAR
        if not swar or (block_k and block_k != w.k_tile):
            raise ValueError(
                f"fp4_matmul_tpu: a record in the tiled K order (k_tile={w.k_tile}) takes a SWAR "
                f"decode and its own K tile, not decode={decode!r}, block_k={block_k}"
            )
        block_k = w.k_tile
    tk = fp4_k_tile(k, blk, swar, block_k, compiled=not interpret)
    if isinstance(w, Mxfp4Weight):
        kind, sbytes = "mx", w.scale
    else:
        kind, sbytes = "nv", w.scale
        if sbytes.dtype != jnp.uint8:  # a TPU engine holds bytes (fp4.scales_as_bytes): no copy a step
            sbytes = lax.bitcast_convert_type(sbytes, jnp.uint8)
    tm = _row_tile(m, x.dtype, block_m)
    mp = _round_up(m, tm)
    tn = fp4_n_tile(n, tm, block_n)
    nk = k // tk
    weight_specs = [
        _spec(stacked, (tk // 2, tn), lambda i, j, kk: (kk, j)),
        _spec(stacked, (k // blk, tn), lambda i, j, kk: (0, j)),
    ]
    if w.k_tile:
        if tk % (4 * blk) or (interpret is None and tk % 512):
            raise ValueError(
                f"fp4_matmul_tpu: k_tile={tk} must be a multiple of {4 * blk} (a whole scale row per "
                f"output) and, compiled, of 512 (x's four column groups in whole 128-lane tiles)"
            )
        x_args = [_pad_rows(x, mp)]  # natural order: the record's codes follow the decode
        x_specs = [_act_spec((tm, tk), lambda i, j, kk: (i, kk))]
        kernel = functools.partial(_fp4_swar_tiled_kernel, tk=tk, block=blk, kind=kind, nk=nk)
    elif swar:
        x_args = [swar_x_order(_pad_rows(x, mp))]  # [4, mp, K/4]
        x_specs = [pl.BlockSpec((4, tm, tk // 4), lambda i, j, kk, layer: (0, i, kk))]
        kernel = functools.partial(
            _fp4_swar_kernel,
            scale_rows=tk // blk,
            block=blk,
            kind=kind,
            nk=nk,
            expand="bcast" if decode == "swar_bcast" else "dot",
        )
    else:
        xp = _pad_rows(x, mp).reshape(mp, k // 2, 2)
        x_args = [xp[..., 0], xp[..., 1]]
        x_specs = [_act_spec((tm, tk // 2), lambda i, j, kk: (i, kk))] * 2
        kernel = functools.partial(
            _fp4_kernel, scale_rows=tk // blk, block=blk, kind=kind, nk=nk, by_int=decode == "int"
        )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(mp // tm, n // tn, nk),
            in_specs=x_specs + weight_specs,
            out_specs=_act_spec((tm, tn), lambda i, j, kk: (i, j)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((mp, n), jnp.float32 if kind == "nv" else out_dtype),
        compiler_params=_compiler_params(_VMEM_LIMIT),
        interpret=interpret if interpret is not None else False,
    )(layer_arr, *x_args, w.packed, sbytes)[:m]
    if isinstance(w, Nvfp4Weight):  # kind == "nv"
        g = w.global_multiplier()  # [*L, 1, 1 or N]: tiny, sliced by XLA
        g = g[layer_arr[0]] if stacked else g
        out = (out * g[0]).astype(out_dtype)  # [1] or per column [N]
    return out


def fp4_matmul_ref(x: jax.Array, w: Mxfp4Weight | Nvfp4Weight, *, out_dtype=None, layer=None) -> jax.Array:
    """Reference for ``fp4_matmul_tpu``: exact dequant, then an f32 GEMM."""
    if layer is not None:
        w = layer_of(w, layer)
    deq = dequantize_mxfp4(w) if isinstance(w, Mxfp4Weight) else dequantize_nvfp4(w)
    y = jnp.dot(
        x.astype(jnp.float32), deq.reshape(w.in_features, w.out_features), precision=lax.Precision.HIGHEST
    )
    return y.astype(out_dtype or x.dtype)


def layer_of(w, layer):
    """One layer of a record stacked over layers (``[L, K, ...]`` -> ``[K, ...]``): an XLA slice,
    for the paths that are not the kernels (references, XLA matmuls)."""
    return jax.tree.map(lambda a: a[layer], w)


def quant_linear_tpu(x, w, bias=None, out_dtype=None, *, layer=None, interpret=None):
    """``linear``-signature wrapper: ``x [..., K]`` -> ``[..., *out]`` through the kernels.
    ``layer``: w is stacked over layers and the kernel reads that layer in place."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(w, Fp8Weight):
        y = fp8_matmul_tpu(x2, w, out_dtype=jnp.float32, layer=layer, interpret=interpret)
    else:
        y = fp4_matmul_tpu(x2, w, out_dtype=jnp.float32, layer=layer, interpret=interpret)
    y = y.reshape(*lead, *w.out_shape)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(out_dtype or x.dtype)

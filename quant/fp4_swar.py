"""FP4 weight decode for the TPU kernels, two bf16 weights per 32-bit lane (SWAR).

Why: a v5e's VPU has 32-bit lanes and no bf16 arithmetic, so decoding one e2m1 code per lane to
f32, scaling it, converting it to bf16 and packing pairs of rows (the ``"f32"`` decode of
``pallas_tpu_matmul``) costs ~20 VPU ops per weight: the kernel ran at ~20% of its HBM roofline,
compute-bound. Here the packed bytes are read four at a time as one int32 *word* (8 codes), the
per-code tests run on all 8 nibbles at once, and each of the 4 outputs is a word holding two
finished bf16 bit patterns that ``pltpu.bitcast`` turns into two bf16 rows for free: no f32
multiply, no f32 -> bf16 conversion, no row interleave.

Word layout
-----------
``pltpu.bitcast(u8 [4r, n] -> i32 [r, n])`` packs byte rows 4i..4i+3 into word row i, byte row
4i+b in bits 8b..8b+7 (jax's interpret rule for the primitive; jax's own TPU test of
``pltpu.bitcast`` compares the chip against that rule, so the chip agrees: high confidence). With
two codes per byte (low nibble = even k), nibble ``c`` of word row i (bits 4c..4c+3) is element
``k = 8i + c``. Output ``j`` (0..3) pairs nibble j (low 16 bits) with nibble j + 4 (high 16 bits):
the two are already 16 bits apart, so extracting them is one shift and one mask. Bitcast to bf16
``[2r, n]``, row 2i is the low half (k = 8i + j) and row 2i + 1 the high half (k = 8i + j + 4):
``swar_x_order`` permutes the activations' K columns to match, once, outside the kernel (the dot
contracts over K, so any order does if x and W agree).

Arithmetic (per 16-bit half; m = mantissa bit, e = two exponent bits, mag = 2e + m)
--------------------------------------------------------------------------------
An e2m1 magnitude times a scale ``c`` is exact in bf16 (2 significant bits times 1 for MX, 4 for
NVFP4's e4m3 <= 8 bits). With ``nz = [mag >= 1]`` and ``gm = [e >= 1 and m]``:

* MXFP4, ``c = 2**(s - 127)``: bits = nz * S + (f << 6), S = (s - 1) << 7, f = mag if mag >= 2
  else 0. mag >= 2 gives exponent field s - 1 + e and mantissa m: 2**(e-1) (1 + m/2) c; mag 1
  gives S = 0.5 c; mag 0 gives 0. ``nz * S`` is one int32 multiply for both halves (nz is 0/1 at
  bits 0 and 16, S < 2**15 so the products do not overlap).
* NVFP4: bits = nz * A + gm * D + (e << 7) with A = bf16 bits of 0.5 |c|, D = bits(1.5 |c|) -
  bits(|c|): the exponent of ``|c| * 2**(e-1)`` is bits(|c|) plus (e - 1) << 7 while normal, and
  1.5 |c| has the same exponent as |c| or one more, which D absorbs. A zero scale has A = D = 0.
* sign: bit 15 of each half = the code's sign bit (XOR the scale's sign for NVFP4), so ``-0.0``
  codes and negative scales come out bit for bit as the reference dequant's.

Per word (8 weights): ~10 ops on all nibbles at once, then per output ~9 (MX) or ~12 (NV) ops;
with the scale terms, ~6 (MX) / ~9 (NV) VPU ops per weight (counted from the jaxpr; the "f32"
decode is ~17 / ~18, "int" ~12 / ~14).

Tiled K order (``k_tile`` of a record, ``tile_order``)
-------------------------------------------------
The order above asks the activations' K columns permuted before every matmul (``swar_x_order``):
on a v5e that transpose was its own XLA op per matmul, ~3.5 us each at batch 1 (15.7 us a layer
of the 8B shape, with the row pad: 5% of its MXFP4 step). A record can instead hold its codes in
the order the decode emits, per K tile of ``tk`` elements: nibble ``j + 4h`` of word row ``i`` holds
element ``j * tk/4 + 2i + h`` of the tile, so output ``j`` is x's natural columns ``[j * tk/4,
(j+1) * tk/4)`` of the tile and x goes in untouched. The scales stay in natural order; output
``j``'s word row ``i`` reads scale row ``j * tk/(4 block) + 2i // block`` of the tile, so each output
has its own scale terms (``decode_words(..., output_terms=...)``), each scale row repeated over
``block / 2`` word rows (16 MX, 8 NVFP4: whole 32-bit sublane tiles, a plain broadcast).

Domain: bit-exact with ``dequantize_mxfp4`` / ``dequantize_nvfp4`` (then cast to bf16) for every
code and e8m0 byte 1..252 (byte 1 with |code| 1, whose 2**-127 is subnormal, gives 0, as bf16
math on a TPU does), and every finite nonzero e4m3 byte. e8m0 bytes 0 and 253..255 (values of
2**-127, inf or NaN), e4m3 NaN and zero scales are out of domain, except that zero codes decode to
their signed zeros under any scale byte: quantizers write e8m0 byte 0 (ours) or a zero e4m3 scale
only for all-zero blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpuserve.quant.codecs import e4m3_bits_decode


def _i32(c: int) -> np.int32:
    """A 32-bit pattern as an int32 constant (patterns >= 2**31 wrap to negative)."""
    return np.uint32(c).view(np.int32)


_EACH_NIBBLE = _i32(0x11111111)  # bit 0 of every nibble
_SIGNS = _i32(0x88888888)  # bit 3 of every nibble
_HALVES = _i32(0x00010001)  # bit 0 of each 16-bit half
_HALF_SIGNS = _i32(0x80008000)


def _srl(a: jax.Array, n: int) -> jax.Array:
    return lax.shift_right_logical(a, jnp.int32(n)) if n else a


def _shift(a: jax.Array, n: int) -> jax.Array:
    """Left by n (n >= 0) or logical right by -n."""
    return a << n if n > 0 else _srl(a, -n)


def mx_scale_terms(sbytes: jax.Array) -> tuple[jax.Array]:
    """e8m0 bytes (any int dtype) -> (S,) int32: (s - 1) << 7, clamped at 0 (byte 0: out of domain)."""
    s = sbytes.astype(jnp.int32)
    return (jnp.maximum(s - 1, 0) << 7,)


def nv_scale_terms(c: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """NVFP4 block scales as f32 values (``e4m3_bits_decode`` of the bytes, exact) -> (A, D,
    flip) int32 (module docstring). flip: the sign pattern (bit 3 of every nibble) to XOR into the
    codes' signs for a negative scale."""
    bits = lax.bitcast_convert_type(c.astype(jnp.float32), jnp.int32)
    mag_bits = bits & _i32(0x7FFFFFFF)
    v1 = _srl(mag_bits, 16)  # bf16 bits of |c| (exact: e4m3 has 4 significant bits)
    v15 = _srl(lax.bitcast_convert_type(lax.bitcast_convert_type(mag_bits, jnp.float32) * 1.5, jnp.int32), 16)
    nonzero = mag_bits != 0
    a = jnp.where(nonzero, v1 - 128, 0)
    d = v15 - v1
    flip = (bits >> 31) & _SIGNS  # arithmetic shift: all ones for a negative scale
    return a, d, flip


def scale_terms(sbytes: jax.Array, kind: str) -> tuple[jax.Array, ...]:
    """Scale bytes (e8m0 for "mx", float8_e4m3fn bits for "nv") -> the terms of ``decode_words``."""
    return mx_scale_terms(sbytes) if kind == "mx" else nv_scale_terms(e4m3_bits_decode(sbytes))


def decode_words(
    words: jax.Array,
    terms: tuple[jax.Array, ...] | None,
    kind: str,
    output_terms: Sequence[tuple[jax.Array, ...]] | None = None,
) -> Iterator[jax.Array]:
    """int32 words ``[r, n]`` (8 codes each) and their scale terms (each ``[r, n]``, or
    broadcastable) -> 4 int32 ``[r, n]``, one at a time: output j holds the bf16 bits of code j
    (low half) and code j + 4 (high half), scaled (module docstring). A generator, so a kernel that
    consumes each output before asking for the next keeps one output live, not four.

    ``output_terms``: instead of ``terms``, one tuple per output (the tiled K order, where the four
    outputs read different scale rows); an NVFP4 flip there is already at the halves' sign bits
    (``& 0x80008000``)."""
    w = words.astype(jnp.int32)
    mag = w & _i32(0x77777777)
    nz = _srl(mag + _i32(0x77777777), 3) & _EACH_NIBBLE  # per nibble: mag + 7 >= 8 <=> mag >= 1
    sign = w & _SIGNS
    per_output = output_terms is not None
    if kind == "mx":
        ge = _srl(mag + _i32(0x66666666), 3) & _EACH_NIBBLE  # mag >= 2
        f = mag + ge - nz  # mag if mag >= 2, else 0 (no nibble leaves 0..8: no carries)
    else:
        if not per_output:
            assert terms is not None
            sign = sign ^ terms[2]  # one flip for all four outputs
        gm = w & (_srl(w, 1) | _srl(w, 2)) & _EACH_NIBBLE  # m and e != 0
    for j in range(4):
        t = output_terms[j] if output_terms is not None else terms
        assert t is not None
        nz_j = _srl(nz, 4 * j) & _HALVES
        sign_j = _shift(sign, 12 - 4 * j) & _HALF_SIGNS
        if kind == "mx":
            body = nz_j * t[0] + (_shift(f, 6 - 4 * j) & _i32(0x01C001C0))
        else:
            gm_j = _srl(gm, 4 * j) & _HALVES
            e_j = _shift(w, 6 - 4 * j) & _i32(0x01800180)  # the code's e (bits 1-2) at bits 7-8
            body = nz_j * t[0] + gm_j * t[1] + e_j
            if per_output:
                sign_j = sign_j ^ t[2]
        yield body | sign_j


def output_flip(flip: jax.Array) -> jax.Array:
    """An NVFP4 flip of ``nv_scale_terms`` as ``decode_words``' ``output_terms`` take it (at the
    halves' sign bits)."""
    return flip & _HALF_SIGNS


def tile_order(tk: int) -> np.ndarray:
    """The tiled K order (module docstring): i32 ``[tk]``, entry ``p`` = the element of a K tile
    whose code sits at nibble position ``p`` (``p = 8i + j + 4h`` holds ``j * tk/4 + 2i + h``)."""
    if tk % 8:
        raise ValueError(f"a tiled K order needs tk a multiple of 8, got {tk}")
    i = np.arange(tk // 8)[:, None, None]
    h = np.arange(2)[None, :, None]
    j = np.arange(4)[None, None, :]
    return (j * (tk // 4) + 2 * i + h).reshape(-1).astype(np.int32)  # [i, h, j]: p = 8i + 4h + j


def tile_codes(codes: jax.Array, tk: int, inverse: bool = False) -> jax.Array:
    """Codes ``[*L, K, N]`` in natural K order -> the tiled order of ``tk`` (``inverse``: back)."""
    *lead, k, n = codes.shape
    if k % tk:
        raise ValueError(f"K={k} is no multiple of the tile {tk}")
    order = tile_order(tk)
    perm = np.argsort(order) if inverse else order
    tiles = codes.reshape(*lead, k // tk, tk, n)
    return jnp.take(tiles, jnp.asarray(perm), axis=-2).reshape(*lead, k, n)


def words_to_bf16_reference(out: jax.Array) -> jax.Array:
    """What ``pltpu.bitcast(out, bf16)`` gives, in plain jnp (tests): int32 ``[r, n]`` ->
    bf16 ``[2r, n]``, row 2i from the low 16 bits of row i, row 2i + 1 from the high 16 bits."""
    halves = lax.bitcast_convert_type(out, jnp.bfloat16)  # [r, n, 2], [..., 0] = low bits
    r, n = out.shape
    return jnp.swapaxes(halves, -1, -2).reshape(2 * r, n)


def lane_decode(b: jax.Array, nibble: int, exp_bias: jax.Array | int) -> jax.Array:
    """The ``"int"`` decode: one code per 32-bit lane, f32 out, by an integer add.

    b: int32 bytes (0..255) ``[...]``; nibble 0 (low, even k) or 1 (high, odd k); exp_bias: int32
    ``[...]`` or a constant, ``(s - 1) << 23`` with s the f32 exponent field of a power-of-two
    scale (MXFP4: the e8m0 byte, clamped at 1; ``126 << 23`` for no scale). For mag = 2e + m with
    e >= 1 the f32 bits ``(mag << 22) + exp_bias`` have exponent s - 1 + e and mantissa m: the code
    times the scale; mag 1 is ``exp_bias`` itself (half the scale), mag 0 is ``0 * exp_bias``. Then
    the code's sign bit. ~10 VPU ops a code, against ~17 for ``e2m1_bits_decode`` and a multiply.
    """
    mag = (_srl(b, 4 * nibble)) & 7
    sign = (b << (28 - 4 * nibble)) & _i32(0x80000000)
    bits = jnp.where(mag >= 2, (mag << 22) + exp_bias, mag * exp_bias) | sign
    return lax.bitcast_convert_type(bits, jnp.float32)


def expand_rows(v: jax.Array, p: int, how: str) -> jax.Array:
    """``[R, tn]`` -> ``[p*R, tn]``, row i repeated into rows p*i .. p*i + p - 1 (p a power of 2).

    "bcast": a broadcast and a reshape that merges a p-row axis into the sublanes (p < 8 rows: not
    whole 32-bit tiles, which Mosaic may relayout slowly or refuse). "dot": an MXU product with the
    0/1 matrix ``[p*R, R]``; exact for values exact in bf16 (integers up to 256, e4m3 values),
    since each output row has one nonzero term (a -0.0 becomes +0.0).
    """
    if p == 1:
        return v
    r, tn = v.shape
    if how == "bcast":
        return jnp.broadcast_to(v[:, None, :], (r, p, tn)).reshape(r * p, tn)
    rows = lax.broadcasted_iota(jnp.int32, (r * p, r), 0) >> (p.bit_length() - 1)
    cols = lax.broadcasted_iota(jnp.int32, (r * p, r), 1)
    ones = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.bfloat16)
    return jnp.dot(ones, v.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def swar_x_order(x: jax.Array) -> jax.Array:
    """x ``[M, K]`` -> ``[4, M, K/4]``: group j holds the columns k = 8i + j + 4h in the order
    (i, h), the row order of decoded output j bitcast to bf16 (row 2i + h). K tiles that are
    multiples of 8 stay contiguous: tile columns [t*tk, (t+1)*tk) are group columns
    [t*tk/4, (t+1)*tk/4)."""
    m, k = x.shape
    xr = x.reshape(m, k // 8, 2, 4)  # (M, i, h, j)
    return jnp.transpose(xr, (3, 0, 1, 2)).reshape(4, m, k // 4)

"""The SWAR FP4 decode (quant/fp4_swar.py) alone, bit for bit against the table decode: every
byte value (so every pair of codes) under every e8m0 and every finite e4m3 scale byte."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tpuserve.quant import fp4_swar
from tpuserve.quant.codecs import E2M1_VALUES, e8m0_decode


def _words_of_all_bytes(n_cols: int) -> np.ndarray:
    """int32 [64, n_cols]: byte row b (0..255) holds the value b in every column, packed four
    byte rows a word the way pltpu.bitcast packs them (byte row 4i + c in bits 8c..8c+7)."""
    rows = np.repeat(np.arange(256, dtype=np.uint8)[:, None], n_cols, axis=1)  # [256, n]
    return np.ascontiguousarray(rows.reshape(64, 4, n_cols).transpose(0, 2, 1)).view("<i4")[..., 0]


def _decode_bits(words: np.ndarray, terms, kind: str) -> np.ndarray:
    """uint16 bf16 bits [256 byte rows, 2 nibbles, n] from the SWAR decode."""
    outs = fp4_swar.decode_words(jnp.asarray(words), terms, kind)
    r, n = words.shape
    got = np.zeros((r, 8, n), np.uint16)  # code c of word row i = element 8i + c
    for j, out in enumerate(outs):
        halves = np.asarray(out).astype("<i4").view("<u2").reshape(r, n, 2)
        got[:, j] = halves[..., 0]
        got[:, j + 4] = halves[..., 1]
    return got.reshape(256, 2, n)  # element 8i + c = byte row 4i + c // 2, nibble c % 2


def _want_bits(scales_f32: np.ndarray) -> np.ndarray:
    b = np.arange(256)
    codes = np.stack([b & 15, b >> 4], axis=1)  # [256, 2]
    with np.errstate(over="ignore"):  # e8m0 bytes past 252 overflow: out of domain, not compared
        vals = E2M1_VALUES[codes][..., None] * scales_f32[None, None, :]  # exact in f32
    return vals.astype(ml_dtypes.bfloat16).view(np.uint16)


def test_mx_every_byte_every_scale():
    sbytes = np.arange(256, dtype=np.uint8)
    got = _decode_bits(_words_of_all_bytes(256), fp4_swar.mx_scale_terms(jnp.asarray(sbytes)[None]), "mx")
    want = _want_bits(np.asarray(e8m0_decode(jnp.asarray(sbytes))))
    domain = slice(1, 253)  # e8m0 bytes 1..252; 0 and 253..255 are out of domain
    mag1_at_byte1 = np.zeros_like(want, bool)
    codes = np.stack([np.arange(256) & 15, np.arange(256) >> 4], axis=1)
    mag1_at_byte1[..., 1] = (codes & 7) == 1
    # byte 1, |code| 1: 2**-127 is subnormal; the decode flushes it to (signed) zero
    flushed = np.where(mag1_at_byte1, want & 0x8000, want)
    np.testing.assert_array_equal(got[..., domain], flushed[..., domain])
    # all-zero blocks (our quantizer writes scale byte 0 for them) decode to signed zeros
    zero_codes = (codes & 7) == 0
    np.testing.assert_array_equal(got[zero_codes][:, 0], want[zero_codes][:, 0])


def test_nv_every_byte_every_finite_nonzero_scale():
    sbytes = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], np.uint8)
    got = _decode_bits(
        _words_of_all_bytes(len(sbytes)), fp4_swar.scale_terms(jnp.asarray(sbytes)[None], "nv"), "nv"
    )
    scales = sbytes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = _want_bits(scales)
    nonzero = scales != 0
    np.testing.assert_array_equal(got[..., nonzero], want[..., nonzero])
    # zero scales (out of domain) still give zero codes their signed zeros
    codes = np.stack([np.arange(256) & 15, np.arange(256) >> 4], axis=1)
    zero_codes = (codes & 7) == 0
    np.testing.assert_array_equal(got[zero_codes][:, ~nonzero], want[zero_codes][:, ~nonzero])


def test_words_to_bf16_reference_row_order():
    # low half -> even row, high half -> odd row (jax's interpret rule for pltpu.bitcast)
    out = jnp.asarray(np.array([[0x3F804000]], np.uint32).view(np.int32))
    np.testing.assert_array_equal(
        np.asarray(fp4_swar.words_to_bf16_reference(out), np.float32), [[2.0], [1.0]]
    )


@pytest.mark.parametrize("k", [8, 64])
def test_x_order_matches_decoded_rows(k):
    x = jnp.arange(3 * k, dtype=jnp.float32).reshape(3, k)
    xs = np.asarray(fp4_swar.swar_x_order(x))
    for j in range(4):
        for i in range(k // 8):
            for h in range(2):
                assert xs[j, 1, 2 * i + h] == x[1, 8 * i + j + 4 * h]


@pytest.mark.parametrize("nibble", [0, 1])
def test_lane_decode_every_byte_every_scale(nibble):
    """The "int" decode: every byte's low or high code under every e8m0 byte 1..252 (byte 1, |code|
    1 flushed as above), and unscaled (the NVFP4 path) bit-exact in f32."""
    b = jnp.arange(256, dtype=jnp.int32)[:, None]
    sbytes = np.arange(1, 253)
    bias = jnp.asarray(np.maximum(sbytes - 1, 0) << 23, jnp.int32)[None]
    got = np.asarray(fp4_swar.lane_decode(b, nibble, bias)).view(np.uint32)
    codes = (np.arange(256) >> (4 * nibble)) & 15
    want = (E2M1_VALUES[codes][:, None] * np.asarray(e8m0_decode(jnp.asarray(sbytes, jnp.uint8)))[None]).view(
        np.uint32
    )
    flush = ((codes & 7) == 1)[:, None] & (sbytes == 1)[None]
    np.testing.assert_array_equal(got, np.where(flush, want & 0x80000000, want))
    plain = np.asarray(fp4_swar.lane_decode(b, nibble, 126 << 23)).view(np.uint32)
    np.testing.assert_array_equal(plain[:, 0], E2M1_VALUES[codes].view(np.uint32))

"""Bit-level codecs shared by every format: e2m1 nibbles, e8m0 and e4m3 scale bytes, exact division.

Two families of decoders live here, on purpose:

* table / dtype based (``e2m1_lut_decode``, ``e8m0_decode``): obviously right, used by the dequant
  references that tests hold bit-exact against the oracles;
* pure integer arithmetic (``e2m1_bits_decode``, ``e8m0_bits_decode``, ``e4m3_bits_decode``):
  only shifts, masks, ``where`` and a bitcast, so they run inside a Pallas TPU kernel (no gathers,
  no fp8/fp4 dtypes in VMEM, which older TPU generations cannot convert). Tests check both
  families agree on every code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The 16 e2m1 codes in order (sign bit 3, two exponent bits, one mantissa bit; no inf, no NaN).
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# e8m0 bias: byte b means 2**(b - 127); 0xFF is NaN and there is no zero.
E8M0_BIAS = 127


def exact_div(a: jax.Array, b: jax.Array) -> jax.Array:
    """IEEE ``a / b`` with ``b`` broadcast to ``a``'s shape.

    XLA:CPU rewrites ``x / broadcast(s)`` into ``x * (1/s)`` (1 ulp off for ~1/3 of elements, even
    with fast math off). Hiding the broadcast behind an optimization barrier keeps a true
    element-wise division, which the oracles (numpy/torch) do and bit-exact tests need.
    """
    a = jnp.asarray(a)
    b = jnp.asarray(b, a.dtype)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a = jnp.broadcast_to(a, shape)
    return a / lax.optimization_barrier(jnp.broadcast_to(b, shape))


# ---------------------------------------------------------------------------------------------
# e2m1 (FP4) elements, two per byte, low nibble first.


def unpack_nibbles(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """u8 ``[...]`` -> (low codes, high codes), each int32 ``[...]`` in 0..15."""
    b = packed.astype(jnp.int32)
    return b & 15, b >> 4


def pack_nibbles(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Codes 0..15 (any int dtype) ``[...]`` x2 -> u8 ``[...]`` with ``lo`` in bits 0-3."""
    return (lo.astype(jnp.uint8) & 15) | ((hi.astype(jnp.uint8) & 15) << 4)


def e2m1_lut_decode(codes: jax.Array) -> jax.Array:
    """Codes (int) ``[...]`` -> f32 ``[...]`` by table lookup (the reference decode)."""
    return jnp.asarray(E2M1_VALUES)[codes]


def e2m1_bits_decode(codes: jax.Array) -> jax.Array:
    """Codes (int32) ``[...]`` -> f32 ``[...]`` with integer ops only (kernel-friendly).

    A magnitude code ``eem`` (e = two exponent bits, m = mantissa bit) is the f32 with exponent
    ``e - 1`` and top mantissa bit ``m`` when e > 0; e == 0 is the subnormal 0 or 0.5.
    """
    mag = codes & 7
    e = mag >> 1
    m = mag & 1
    bits = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    bits = bits | ((codes & 8) << 28)  # sign: bit 3 of the code -> bit 31
    return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def e2m1_encode(x: jax.Array) -> jax.Array:
    """f32 ``[...]`` -> codes u8 ``[...]``: round to nearest even, saturating at +-6.

    The cast to ``float4_e2m1fn`` does RNE and saturates (ml_dtypes semantics); its bit pattern is
    the code. Clipping first keeps inf/NaN-free inputs in range either way.
    """
    f4 = jnp.clip(x.astype(jnp.float32), -E2M1_MAX, E2M1_MAX).astype(jnp.float4_e2m1fn)
    # fp4 -> u4 -> u8: a same-width bitcast, then a widening integer convert.
    return lax.bitcast_convert_type(f4, jnp.uint4).astype(jnp.uint8)


# ---------------------------------------------------------------------------------------------
# e8m0 (MX) scale bytes.


def e8m0_decode(b: jax.Array) -> jax.Array:
    """u8 ``[...]`` -> f32 ``2**(b-127)``; byte 0 is the subnormal 2**-127, 255 is NaN.

    Built from the f32 exponent field; byte 0 (which has no normal f32) is spelled out, since
    ``jnp.ldexp`` flushes it to 0 on XLA:CPU.
    """
    b = b.astype(jnp.int32)
    v = lax.bitcast_convert_type(b << 23, jnp.float32)
    v = jnp.where(b == 0, jnp.float32(2.0**-127), v)
    return jnp.where(b == 255, jnp.float32(jnp.nan), v)


def e8m0_bits_decode(b: jax.Array) -> jax.Array:
    """u8/int ``[...]`` -> f32 by placing the byte in the f32 exponent field (kernel-friendly).

    Differs from ``e8m0_decode`` only at byte 0 (gives 0.0 instead of 2**-127, which TPUs flush
    anyway) and 255 (inf instead of NaN); neither is produced by our quantizers.
    """
    return lax.bitcast_convert_type(b.astype(jnp.int32) << 23, jnp.float32)


# ---------------------------------------------------------------------------------------------
# e4m3fn scale bytes (NVFP4 block scales), decoded from their bits.


def e4m3_bits_decode(b: jax.Array) -> jax.Array:
    """u8/int ``[...]`` holding float8_e4m3fn bits -> f32 (integer ops; NaN codes are not handled).

    Normal: exponent ``E - 7`` -> f32 exponent field ``E + 120``, 3 mantissa bits -> the top 3 f32
    mantissa bits. Subnormal (E == 0): ``m * 2**-9``.
    """
    b = b.astype(jnp.int32)
    exp = (b >> 3) & 15
    man = b & 7
    normal = lax.bitcast_convert_type(((exp + 120) << 23) | (man << 20), jnp.float32)
    sub = man.astype(jnp.float32) * jnp.float32(2.0**-9)
    mag = jnp.where(exp == 0, sub, normal)
    return jnp.where((b & 0x80) != 0, -mag, mag)


def to_e4m3(x: jax.Array) -> jax.Array:
    """f32 -> float8_e4m3fn, saturating at +-448.

    jax/ml_dtypes turn values past 464 into NaN, torch saturates; clipping first gives torch's
    (and every checkpoint producer's) answer.
    """
    return jnp.clip(x.astype(jnp.float32), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)

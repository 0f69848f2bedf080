"""FP4 (e2m1) weights: MXFP4 (32-blocks, e8m0 scales) and NVFP4 (16-blocks, e4m3 scales, f32 global).

Layout: the dense weight is ``[*L, K, *out]`` (K contracted). Records keep it as

* ``packed``  u8 ``[*L, K/2, N]``: byte ``[i, n]`` holds elements ``k = 2i`` (low nibble) and
  ``k = 2i + 1`` (high nibble) of column n. This is every HF-side checkpoint's pairing (torchao
  ``pack_uint4``, compressed-tensors ``pack_fp4_to_uint8``, ModelOpt, gpt-oss), only transposed
  from ``[out, in/2]``: packing stays along the contracted axis, so a matmul tile of K rows is a
  tile of K/2 byte rows plus K/block scale rows.
* ``scale``   ``[*L, K/block, N]``: one scale per ``block`` consecutive K elements of a column.

K must be a multiple of the block (32 or 16). GGUF stores both formats with a different nibble
order (split halves); ``*_from_gguf`` re-packs them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.quant.codecs import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_encode,
    e2m1_lut_decode,
    e8m0_decode,
    exact_div,
    pack_nibbles,
    unpack_nibbles,
)
from tpuserve.quant.fp4_swar import tile_codes

MXFP4_BLOCK = 32
_E4M3_SMALLEST_NORMAL = 2.0**-6  # torchao's E4M3_EPS: block scales never go subnormal
NVFP4_BLOCK = 16


class _PackedFp4:
    """Shape accessors shared by the two FP4 records (two e2m1 codes per byte along K)."""

    packed: jax.Array

    @property
    def in_features(self) -> int:
        return self.packed.shape[-2] * 2

    @property
    def out_features(self) -> int:
        return self.packed.shape[-1]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("packed", "scale"),
    meta_fields=("out_shape", "rotated", "k_tile"),
)
@dataclasses.dataclass(frozen=True)
class Mxfp4Weight(_PackedFp4):
    """OCP MXFP4 weight ``[*L, K, *out_shape]``.

    packed: u8 ``[*L, K/2, N]`` (two e2m1 codes per byte, low nibble = even k).
    scale: u8 ``[*L, K/32, N]``, raw e8m0 bytes (value ``2**(b-127)``).
    out_shape: the output axes (prod = N), static.
    rotated: static. True: the codes hold ``R W`` for the block-diagonal Hadamard rotation R of
      ``hadamard_blocks`` (one orthonormal 32 x 32 block per scale block), and a matmul reads
      ``(x R) @ (R W) = x W``. Rotating spreads a block's outliers over its 32 values, which suits
      a power-of-two scale (our calibrated quantizer's choice; checkpoints are never rotated).
    k_tile: static. 0: codes in natural K order; else the TPU kernel's tiled K order for tiles of
      that many elements (``quant/fp4_swar.py``, ``tile_k_order``); scales stay in natural order.
    """

    packed: jax.Array
    scale: jax.Array
    out_shape: tuple[int, ...]
    rotated: bool = False
    k_tile: int = 0

    block = MXFP4_BLOCK

    @property
    def nbytes(self) -> int:
        return int(self.packed.size + self.scale.size)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("packed", "scale", "global_scale"),
    meta_fields=("out_shape", "global_divides", "k_tile"),
)
@dataclasses.dataclass(frozen=True)
class Nvfp4Weight(_PackedFp4):
    """NVFP4 weight ``[*L, K, *out_shape]``.

    packed: u8 ``[*L, K/2, N]``.
    scale: float8_e4m3fn ``[*L, K/16, N]`` block scales, or u8 holding the same bytes (how a TPU
      engine keeps them: ``scales_as_bytes``); read values with ``nv_scale_values``.
    global_scale: f32 ``[*L, 1, 1]``, kept exactly as the producer wrote it; or ``[*L, 1, N]``
      when tensors with different globals were fused along N (``quant/fuse.py``: q|k|v, gate|up).
    global_divides: static. The two checkpoint families invert the global scale:
      False (ModelOpt ``weight_scale_2`` = amax/2688, torchao): ``w = e2m1 * (scale * global)``;
      True (compressed-tensors ``weight_global_scale`` = 2688/amax): ``w = e2m1 * (scale / global)``.
      Keeping the producer's number and operation makes our dequant bit-exact with each.
    k_tile: static, as for ``Mxfp4Weight``.
    """

    packed: jax.Array
    scale: jax.Array
    global_scale: jax.Array
    out_shape: tuple[int, ...]
    global_divides: bool = False
    k_tile: int = 0

    block = NVFP4_BLOCK

    @property
    def nbytes(self) -> int:
        return int(self.packed.size + self.scale.size + self.global_scale.size * 4)

    def global_multiplier(self) -> jax.Array:
        """f32 ``[*L, 1, 1 or N]`` to multiply a scale by (1/global for the dividing convention)."""
        g = self.global_scale.astype(jnp.float32)
        return exact_div(jnp.float32(1.0), g) if self.global_divides else g


# ---------------------------------------------------------------------------------------------
# Shared packing helpers.


def unpack_codes(packed: jax.Array) -> jax.Array:
    """u8 ``[*L, K/2, N]`` -> int32 codes ``[*L, K, N]`` (even k from the low nibble)."""
    lo, hi = unpack_nibbles(packed)
    codes = jnp.stack([lo, hi], axis=-2)  # [*L, K/2, 2, N]
    return codes.reshape(*packed.shape[:-2], packed.shape[-2] * 2, packed.shape[-1])


def natural_codes(w) -> jax.Array:
    """An FP4 record's codes ``[*L, K, N]`` in natural K order (undoing a tiled ``k_tile``)."""
    codes = unpack_codes(w.packed)
    return tile_codes(codes, w.k_tile, inverse=True) if w.k_tile else codes


def tile_k_order(w, tk: int):
    """The record with its codes in the TPU kernel's tiled K order for K tiles of ``tk`` elements
    (``quant/fp4_swar.py``): x then goes into the kernel in natural order, with no transpose
    before each matmul. Scales, global scales and every other field are unchanged."""
    if w.k_tile:
        raise ValueError(f"the record's K order is already tiled (k_tile={w.k_tile})")
    return dataclasses.replace(w, packed=pack_codes(tile_codes(unpack_codes(w.packed), tk)), k_tile=tk)


def pack_codes(codes: jax.Array) -> jax.Array:
    """Codes ``[*L, K, N]`` -> u8 ``[*L, K/2, N]`` (inverse of ``unpack_codes``)."""
    *lead, k, n = codes.shape
    pairs = codes.reshape(*lead, k // 2, 2, n)
    return pack_nibbles(pairs[..., 0, :], pairs[..., 1, :])


def _split(w, num_lead: int, block: int):
    w = jnp.asarray(w)
    lead, k, out = w.shape[:num_lead], w.shape[num_lead], tuple(w.shape[num_lead + 1 :])
    if k % block:
        raise ValueError(f"FP4 needs in_features divisible by {block}, got {k}")
    n = math.prod(out)
    return w.astype(jnp.float32).reshape(*lead, k, n), lead, k, n, out


def _per_block(x: jax.Array, block: int) -> jax.Array:
    """``[*L, K, N]`` -> ``[*L, K/block, block, N]``."""
    *lead, k, n = x.shape
    return x.reshape(*lead, k // block, block, n)


def _repeat_rows(s: jax.Array, block: int) -> jax.Array:
    return jnp.repeat(s, block, axis=-2)


# ---------------------------------------------------------------------------------------------
# MXFP4.


def dequantize_mxfp4(w: Mxfp4Weight, dtype=jnp.float32) -> jax.Array:
    """Reference dequant ``e2m1(code) * 2**(e-127)`` -> ``[*L, K, *out_shape]``.

    Bit-exact with torchao ``MXTensor.dequantize``, compressed-tensors' MXFP4 decompressor and
    gguf's MXFP4 (after ``mxfp4_from_gguf``): every product is exact (2 significant bits times a
    power of two).
    """
    vals = e2m1_lut_decode(natural_codes(w))
    y = vals * _repeat_rows(e8m0_decode(w.scale), MXFP4_BLOCK)
    if w.rotated:  # back from R W to W (R is its own inverse)
        y = hadamard_blocks(y, axis=-2)
    return y.reshape(*y.shape[:-1], *w.out_shape).astype(dtype)


def hadamard32() -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix of order 32 (symmetric, its own inverse)."""
    h = np.ones((1, 1))
    while h.shape[0] < MXFP4_BLOCK:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(MXFP4_BLOCK)


def hadamard_blocks(x: jax.Array, axis: int = -1) -> jax.Array:
    """Multiply each run of 32 consecutive elements along ``axis`` by the orthonormal Hadamard
    matrix: ``x R`` for activations (axis -1), ``R W`` for weights ``[K, N]`` (axis -2)."""
    axis = axis % x.ndim
    k = x.shape[axis]
    if k % MXFP4_BLOCK:
        raise ValueError(f"block Hadamard needs a multiple of {MXFP4_BLOCK} elements, got {k}")
    h = jnp.asarray(hadamard32(), jnp.float32)
    xb = x.reshape(*x.shape[:axis], k // MXFP4_BLOCK, MXFP4_BLOCK, *x.shape[axis + 1 :])
    y = jnp.tensordot(
        xb.astype(jnp.float32), h, axes=((axis + 1,), (0,)), precision=jax.lax.Precision.HIGHEST
    )  # the 32-axis moves last
    y = jnp.moveaxis(y, -1, axis + 1)
    return y.reshape(x.shape).astype(x.dtype)


def quantize_mxfp4(w, *, num_lead: int = 0) -> Mxfp4Weight:
    """OCP MX v1.0 quantization of ``[*L, K, *out]`` (blocks of 32 along K).

    shared exponent = floor(log2(amax)) - 2 (e2m1's emax), read off the f32 exponent bits and
    clamped to e8m0's range; elements = RNE(x / 2**e) saturated at +-6. This is torchao's
    ``ScaleCalculationMode.FLOOR`` (its default), including the clamp of the divisor to the
    smallest normal f32 for all-zero / tiny blocks.
    """
    w2, lead, k, n, out = _split(w, num_lead, MXFP4_BLOCK)
    xb = _per_block(w2, MXFP4_BLOCK)
    amax = jnp.max(jnp.abs(xb), axis=-2, keepdims=True)  # [*L, K/32, 1, N]
    pow2 = ((jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 255) - 127
    e = jnp.clip(pow2 - 2, -127, 128)
    byte = (e + 127).astype(jnp.uint8)
    divisor = jnp.maximum(
        jax.lax.bitcast_convert_type(byte.astype(jnp.int32) << 23, jnp.float32),
        jnp.float32(np.finfo(np.float32).tiny),
    )
    codes = e2m1_encode(exact_div(xb, divisor)).reshape(*lead, k, n)
    return Mxfp4Weight(pack_codes(codes), byte[..., 0, :], out)


def mxfp4_from_checkpoint(packed, scale, *, out_shape=None, xp=jnp) -> Mxfp4Weight:
    """From ``[*E, out, in/2]`` u8 codes and ``[*E, out, in/32]`` u8 e8m0 scales (HF layout).

    This is compressed-tensors ``mxfp4-pack-quantized`` (``weight_packed``/``weight_scale``) and,
    after ``blocks.reshape(*E, out, in/2)``, gpt-oss' ``*_blocks``/``*_scales``.
    xp: ``jnp``, or ``np`` for views of the stored tensors, unread (``fp8_from_checkpoint``).
    """
    packed = xp.asarray(packed, xp.uint8)
    scale = xp.asarray(scale, xp.uint8)
    n = packed.shape[-2]
    if scale.shape[-2:] != (n, packed.shape[-1] * 2 // MXFP4_BLOCK):
        raise ValueError(f"MXFP4 scale shape {scale.shape} does not fit packed {packed.shape}")
    return Mxfp4Weight(
        xp.swapaxes(packed, -1, -2), xp.swapaxes(scale, -1, -2), tuple(out_shape) if out_shape else (n,)
    )


def mxfp4_from_gguf(raw: np.ndarray, shape: tuple[int, int], *, out_shape=None) -> Mxfp4Weight:
    """GGML type MXFP4 (39) bytes of a ``[out, in]`` tensor -> record.

    Each 17-byte block: one e8m0 byte, then 16 bytes whose low nibbles are elements 0..15 and
    high nibbles 16..31 (split halves, unlike the HF pairing). gguf's doubled value table and
    halved scale cancel, so scale bytes and codes carry over unchanged; only the order changes.
    """
    out, k = shape
    blocks = np.asarray(raw, np.uint8).reshape(out, k // MXFP4_BLOCK, 17)
    e, qs = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(out, k)  # element order
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return mxfp4_from_checkpoint(packed, e, out_shape=out_shape)


# ---------------------------------------------------------------------------------------------
# NVFP4.


def nv_scale_values(scale: jax.Array) -> jax.Array:
    """NVFP4 block scales as f32, from float8_e4m3fn values or their u8 bytes."""
    if scale.dtype == jnp.uint8:
        scale = jax.lax.bitcast_convert_type(scale, jnp.float8_e4m3fn)
    return scale.astype(jnp.float32)


def scales_as_bytes(tree):
    """``tree`` with every ``Nvfp4Weight``'s e4m3 scales held as their u8 bytes, once.

    For the TPU kernels, which read scale bytes: a ``bitcast_convert_type`` inside the step is a
    copy on XLA:TPU (the 1B shape's NVFP4 step wrote 58 MiB of scale copies a step, all layers'
    stacked scales). Other records and leaves are returned as they are."""

    def one(w):
        if isinstance(w, Nvfp4Weight) and w.scale.dtype != jnp.uint8:
            return dataclasses.replace(w, scale=jax.lax.bitcast_convert_type(w.scale, jnp.uint8))
        return w

    return jax.tree.map(one, tree, is_leaf=lambda a: isinstance(a, Nvfp4Weight))


def dequantize_nvfp4(w: Nvfp4Weight, dtype=jnp.float32) -> jax.Array:
    """Reference dequant -> ``[*L, K, *out_shape]``: ``e2m1 * (f32(scale) op global)``.

    The per-block factor is formed first, then applied, with the producer's operation
    (``* weight_scale_2`` for ModelOpt/torchao, ``/ weight_global_scale`` for compressed-tensors);
    that order is what makes it bit-exact with each (the facts file, section 1.4).
    """
    s = nv_scale_values(w.scale)
    g = w.global_scale.astype(jnp.float32)
    block_factor = exact_div(s, g) if w.global_divides else s * g
    vals = e2m1_lut_decode(natural_codes(w))
    y = vals * _repeat_rows(block_factor, NVFP4_BLOCK)
    return y.reshape(*y.shape[:-1], *w.out_shape).astype(dtype)


def quantize_nvfp4(w, *, num_lead: int = 0) -> Nvfp4Weight:
    """NVFP4 quantization of ``[*L, K, *out]`` with a per-tensor (per leading index) global scale.

    ModelOpt's recipe as torchao implements it (``per_tensor_amax_to_scale`` + ``nvfp4_quantize``):
    global = amax / (448 * 6); block scale = e4m3(clamp((block_amax / 6) / global, 2**-6, 448));
    elements = saturate(RNE(x * ((1 / global) / block_scale))). Stored ModelOpt-style
    (``global_divides=False``).
    """
    w2, lead, k, n, out = _split(w, num_lead, NVFP4_BLOCK)
    red = tuple(range(len(lead), len(lead) + 2))
    amax = jnp.max(jnp.abs(w2), axis=red, keepdims=True)  # [*L, 1, 1]
    g = exact_div(amax, jnp.float32(E4M3_MAX * E2M1_MAX))
    g = jnp.where(amax > 0, g, jnp.float32(1.0))  # an all-zero tensor: any scale gives zeros
    xb = _per_block(w2, NVFP4_BLOCK)
    bamax = jnp.max(jnp.abs(xb), axis=-2, keepdims=True)  # [*L, K/16, 1, N]
    g4 = g[..., None]
    scaled = exact_div(exact_div(bamax, jnp.float32(E2M1_MAX)), g4)
    s8 = jnp.clip(scaled, jnp.float32(_E4M3_SMALLEST_NORMAL), jnp.float32(E4M3_MAX)).astype(jnp.float8_e4m3fn)
    recip = exact_div(exact_div(jnp.float32(1.0), g4), s8.astype(jnp.float32))
    codes = e2m1_encode(xb * recip).reshape(*lead, k, n)
    return Nvfp4Weight(pack_codes(codes), s8[..., 0, :], g, out, False)


def nvfp4_from_checkpoint(
    packed, scale, global_scale, *, global_divides: bool, out_shape=None, xp=jnp
) -> Nvfp4Weight:
    """From HF-layout tensors: packed u8 ``[out, in/2]``, scale e4m3 ``[out, in/16]``, global f32.

    ModelOpt: ``weight``, ``weight_scale``, ``weight_scale_2`` -> ``global_divides=False``.
    compressed-tensors ``nvfp4-pack-quantized``: ``weight_packed``, ``weight_scale``,
    ``weight_global_scale`` -> ``global_divides=True``.
    xp: ``jnp``, or ``np`` for views of the stored tensors, unread (``fp8_from_checkpoint``).
    """
    packed = xp.asarray(packed, xp.uint8)
    scale = xp.asarray(scale)
    if scale.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"NVFP4 block scales must be float8_e4m3fn, got {scale.dtype}")
    n = packed.shape[-2]
    if scale.shape[-2:] != (n, packed.shape[-1] * 2 // NVFP4_BLOCK):
        raise ValueError(f"NVFP4 scale shape {scale.shape} does not fit packed {packed.shape}")
    g = xp.asarray(global_scale, xp.float32).reshape(*packed.shape[:-2], 1, 1)
    return Nvfp4Weight(
        xp.swapaxes(packed, -1, -2),
        xp.swapaxes(scale, -1, -2),
        g,
        tuple(out_shape) if out_shape else (n,),
        global_divides,
    )


def nvfp4_from_gguf(raw: np.ndarray, shape: tuple[int, int], *, out_shape=None) -> Nvfp4Weight:
    """GGML type NVFP4 (40) bytes of a ``[out, in]`` tensor -> record (global scale 1).

    Each 36-byte block covers 64 elements: four unsigned-e4m3 scale bytes (one per 16), then four
    8-byte groups whose low nibbles are elements 0..7 and high nibbles 8..15 of that 16. gguf
    ignores the sign bit of a scale and reads 0x7F as 0; both are mapped onto e4m3fn bytes here.
    """
    out, k = shape
    blocks = np.asarray(raw, np.uint8).reshape(out, k // 64, 36)
    d, qs = blocks[..., :4], blocks[..., 4:].reshape(out, k // 64, 4, 8)
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(out, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    low = d & 0x7F
    scale_bytes = np.where(low == 0x7F, 0, low).astype(np.uint8).reshape(out, k // NVFP4_BLOCK)
    scale = scale_bytes.view(jnp.float8_e4m3fn)
    return nvfp4_from_checkpoint(packed, scale, np.float32(1.0), global_divides=False, out_shape=out_shape)

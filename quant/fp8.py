"""FP8 (e4m3fn) weights with per-tensor, per-output-channel or 2-D block scales.

Layout (this repo's weight convention, ``tpu_platform/linear.py``): the dense weight is
``[*L, K, *out]`` (K = in features, contracted; ``*L`` optional stacked-layer axes). The record keeps
it flattened to ``[*L, K, N]`` (N = prod(out)), ``out_shape`` restores the output axes.

One scale representation covers every granularity: ``scale [*L, ceil(K/bk), ceil(N/bn)]`` f32 with
a static block ``(bk, bn)``; element ``[k, n]`` dequantizes as ``q[k, n] * scale[k // bk, n // bn]``.

* per-tensor:  block ``(K, N)``  -> scale ``[1, 1]``
* per-channel: block ``(K, 1)``  -> scale ``[1, N]``
* block:       block ``(128, 128)`` (HF "fp8" ``weight_block_size``, compressed-tensors FP8_BLOCK)

Edge blocks may be ragged (K or N not a multiple of the block). Every producer's scale multiplies,
whatever it is called (HF ``weight_scale_inv``, compressed-tensors ``weight_scale``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.quant.codecs import E4M3_MAX, exact_div, to_e4m3

GRANULARITIES = ("tensor", "channel", "block")
_F32_EPS = np.float32(np.finfo(np.float32).eps)  # compressed-tensors' stand-in for a zero scale


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("qweight", "scale"),
    meta_fields=("block", "out_shape", "act_quant"),
)
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """An FP8 e4m3fn weight ``[*L, K, *out_shape]`` and its multiplying scales.

    qweight: float8_e4m3fn ``[*L, K, N]``.
    scale: f32 ``[*L, ceil(K/bk), ceil(N/bn)]``.
    block: ``(bk, bn)``, static.
    out_shape: the output axes (prod = N), static.
    act_quant: static; True runs W8A8 (activations quantized per token to e4m3 on the fly),
      False runs W8A16 (activations stay in their dtype).
    """

    qweight: jax.Array
    scale: jax.Array
    block: tuple[int, int]
    out_shape: tuple[int, ...]
    act_quant: bool = False

    @property
    def in_features(self) -> int:
        return self.qweight.shape[-2]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[-1]

    @property
    def granularity(self) -> str:
        bk, bn = self.block
        if bk >= self.in_features and bn >= self.out_features:
            return "tensor"
        if bk >= self.in_features and bn == 1:
            return "channel"
        return "block"

    @property
    def nbytes(self) -> int:
        return int(self.qweight.size * 1 + self.scale.size * self.scale.dtype.itemsize)


def _expand(scale: jax.Array, block: tuple[int, int], k: int, n: int) -> jax.Array:
    """``[*L, Kb, Nb]`` -> ``[*L, K, N]`` (each scale repeated over its block, edges cut)."""
    bk, bn = block
    s = jnp.repeat(scale, min(bk, k), axis=-2)[..., :k, :]
    return jnp.repeat(s, min(bn, n), axis=-1)[..., :n]


def dequantize_fp8(w: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    """Reference dequant: ``f32(q) * scale`` -> ``[*L, K, *out_shape]`` in ``dtype``.

    Bit-exact with transformers' ``_dequantize_fp8_weight`` and compressed-tensors' decompressor
    (both upcast the fp8 value to f32 and multiply by the f32 scale once).
    """
    k, n = w.in_features, w.out_features
    y = w.qweight.astype(jnp.float32) * _expand(w.scale.astype(jnp.float32), w.block, k, n)
    return y.reshape(*y.shape[:-1], *w.out_shape).astype(dtype)


def _block_for(granularity: str, k: int, n: int, block_size) -> tuple[int, int]:
    if granularity == "tensor":
        return (k, n)
    if granularity == "channel":
        return (k, 1)
    if granularity == "block":
        bk, bn = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        return (int(bk), int(bn))
    raise ValueError(f"FP8 granularity must be one of {GRANULARITIES}, got {granularity!r}")


def _block_amax(w: jax.Array, block: tuple[int, int]) -> jax.Array:
    """``|w|`` max per block: ``[*L, K, N]`` -> ``[*L, Kb, Nb]`` (zero-padded ragged edges)."""
    *lead, k, n = w.shape
    bk, bn = block
    kb, nb = math.ceil(k / bk), math.ceil(n / bn)
    pad = [(0, 0)] * len(lead) + [(0, kb * bk - k), (0, nb * bn - n)]
    a = jnp.pad(jnp.abs(w), pad).reshape(*lead, kb, bk, nb, bn)
    return a.max(axis=(-3, -1))


def quantize_fp8(
    w: jax.Array, granularity: str = "channel", *, block_size=128, num_lead: int = 0, act_quant: bool = False
) -> Fp8Weight:
    """Quantize a dense weight ``[*L, K, *out]`` (``num_lead`` = len(L)) to FP8 e4m3fn.

    scale = amax / 448 per block (f32 eps for an all-zero block, which keeps it positive and its
    elements 0), q = saturate(w / scale): the compressed-tensors recipe (``calculate_qparams`` then
    ``quantize``), so bytes and scales match llm-compressor's. Values that round past 448 saturate instead of becoming NaN.
    """
    w = jnp.asarray(w)
    lead, k, out = w.shape[:num_lead], w.shape[num_lead], tuple(w.shape[num_lead + 1 :])
    n = math.prod(out)
    w2 = w.astype(jnp.float32).reshape(*lead, k, n)
    block = _block_for(granularity, k, n, block_size)
    amax = _block_amax(w2, block)
    scale = jnp.where(amax > 0, exact_div(amax, jnp.float32(E4M3_MAX)), _F32_EPS)
    q = to_e4m3(exact_div(w2, _expand(scale, block, k, n)))
    return Fp8Weight(q, scale, block, out, act_quant)


def fp8_from_checkpoint(
    weight, scale, *, block_size=None, out_shape=None, act_quant: bool = False, xp=jnp
) -> Fp8Weight:
    """Build a record from checkpoint tensors in HF's ``[out, in]`` layout.

    weight: e4m3fn ``[out, in]``. scale (multiplies): HF ``weight_scale_inv`` ``[ceil(out/bo),
    ceil(in/bi)]`` with ``block_size = [bo, bi]``, or compressed-tensors ``weight_scale``: ``[out, 1]``
    (per channel), ``[1]`` / scalar (per tensor) or ``[ceil(out/bo), ceil(in/bi)]`` (block).
    Arrays may be numpy (ml_dtypes) or jax. The transpose to ``[in, out]`` happens here, once.
    xp: ``jnp`` (the record's arrays on the device) or ``np`` (numpy; the weight stays a transposed
    view of ``weight``, unread: the loader's per-slice reads, weights._fused_lazy).
    """
    weight = xp.asarray(weight)
    if weight.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"FP8 checkpoint weight must be float8_e4m3fn, got {weight.dtype}")
    n, k = weight.shape
    scale = xp.asarray(scale, xp.float32)
    if block_size is not None:
        bo, bi = (int(b) for b in block_size)
        want = (math.ceil(n / bo), math.ceil(k / bi))
        if scale.shape != want:
            raise ValueError(f"block scale shape {scale.shape}, expected {want} for block {block_size}")
        block, s = (bi, bo), scale.T
    elif scale.size == 1:
        block, s = (k, n), scale.reshape(1, 1)
    elif scale.shape in ((n, 1), (n,)):
        block, s = (k, 1), scale.reshape(1, n)
    else:
        raise ValueError(
            f"cannot tell the FP8 scale granularity of shape {scale.shape} for weight {weight.shape}"
        )
    return Fp8Weight(weight.T, s, block, tuple(out_shape) if out_shape else (n,), act_quant)


def quantize_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token activation quant: ``x [M, K]`` -> (e4m3fn ``[M, K]``, f32 scale ``[M, 1]``).

    scale = amax(|x_row|) / 448 (f32 eps for a zero row), xq = saturate(x / scale): what
    compressed-tensors' dynamic per-token FP8 activations do, bit for bit.
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, exact_div(amax, jnp.float32(E4M3_MAX)), _F32_EPS)
    return to_e4m3(exact_div(xf, scale)), scale


def scale_columns(w: Fp8Weight) -> jax.Array:
    """The scale expanded along N only: ``[*L, Kb, N]`` f32 (what the matmuls index per K block)."""
    bn = w.block[1]
    n = w.out_features
    return jnp.repeat(w.scale.astype(jnp.float32), min(bn, n), axis=-1)[..., :n]

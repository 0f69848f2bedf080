"""Quantized ``linear`` for CPU and GPU: plain jnp that XLA fuses (dequant in registers, one GEMM).

Each function has ``linear``'s signature ``fn(x [..., K], w, bias [*out] | None, out_dtype) ->
[..., *out]`` (``tpu_platform/linear.py``). Products accumulate in f32; the result comes back
in ``out_dtype`` (default: the activation dtype).

* FP8 per-tensor / per-channel: the scale does not vary along K, so it is applied to the GEMM's
  output (N multiplies per row) instead of to the weight (K*N): ``(x @ f32(q)) * s``.
  W8A8 quantizes x per token and runs an fp8 x fp8 dot (XLA:CPU and GPU both accept it).
* FP8 blocks: the scale varies along K, so the weight is dequantized in the GEMM's input fusion.
* FP4: ``x`` is split into even and odd K columns and each meets the low / high nibbles of the
  packed bytes (two half-K GEMMs), so the weight is never re-interleaved; the nibbles are decoded
  with a same-width bitcast to ``float4_e2m1fn`` (an XLA convert, no gather).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpuserve.quant.codecs import e8m0_decode, exact_div
from tpuserve.quant.fp4 import Mxfp4Weight, Nvfp4Weight, nv_scale_values
from tpuserve.quant.fp8 import Fp8Weight, dequantize_fp8, quantize_per_token, scale_columns


def _finish(y: jax.Array, lead, w, bias, out_dtype, x_dtype) -> jax.Array:
    y = y.reshape(*lead, *w.out_shape)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(out_dtype or x_dtype)


def fp8_linear_xla(x, w: Fp8Weight, bias=None, out_dtype=None):
    """``x [..., K] @ w`` for an FP8 record (W8A16, or W8A8 when ``w.act_quant``)."""
    k, n = w.in_features, w.out_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if w.act_quant:
        xq, sx = quantize_per_token(x2)
    if w.block[0] >= k:  # one scale row: it factors out of the K sum
        s = scale_columns(w)[0]  # [N]
        if w.act_quant:
            y = lax.dot(xq, w.qweight, preferred_element_type=jnp.float32) * sx
        else:
            y = jnp.dot(x2, w.qweight.astype(x2.dtype), preferred_element_type=jnp.float32)
        y = y * s
    else:
        xin = (xq.astype(jnp.float32) * sx).astype(x2.dtype) if w.act_quant else x2
        wd = dequantize_fp8(w, x2.dtype).reshape(k, n)
        y = jnp.dot(xin, wd, preferred_element_type=jnp.float32)
    return _finish(y, lead, w, bias, out_dtype, x.dtype)


def fp4_block_factor(w) -> jax.Array:
    """f32 ``[K/block, N]``: the full multiplier of each block (e8m0 value, or e4m3 x global)."""
    if isinstance(w, Mxfp4Weight):
        return e8m0_decode(w.scale)
    s = nv_scale_values(w.scale)
    g = w.global_scale.astype(jnp.float32)  # [1, 1], or [1, N] for fused tensors
    # the producer's own operation (see Nvfp4Weight): exact, and cheap at K/16 x N elements
    return exact_div(s, g) if w.global_divides else s * g


def fp4_linear_xla(x, w, bias=None, out_dtype=None):
    """``x [..., K] @ w`` for an MXFP4 / NVFP4 record (W4A16)."""
    if w.k_tile:
        raise ValueError(
            f"fp4_linear_xla reads codes in natural K order; this record holds the TPU kernel's "
            f"tiled order (k_tile={w.k_tile})"
        )
    k = w.in_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k // 2, 2)
    pair = lax.bitcast_convert_type(w.packed, jnp.float4_e2m1fn)  # [K/2, N, 2]: [..., 0] = low
    s = jnp.repeat(fp4_block_factor(w), w.block // 2, axis=-2)  # [K/2, N]
    wd = (pair.astype(jnp.float32) * s[..., None]).astype(x.dtype)  # [K/2, N, 2]
    # One dot contracting (K/2, 2) at once: under tensor parallelism a row-split weight then
    # leaves one partial sum to all-reduce, not one per nibble.
    y = lax.dot_general(x2, wd, (((1, 2), (0, 2)), ((), ())), preferred_element_type=jnp.float32)
    return _finish(y, lead, w, bias, out_dtype, x.dtype)


XLA_IMPLS = {Fp8Weight: fp8_linear_xla, Mxfp4Weight: fp4_linear_xla, Nvfp4Weight: fp4_linear_xla}

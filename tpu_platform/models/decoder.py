"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3) in JAX over a ragged batch and paged KV.

One function, ``forward``, serves all four: the differences are flags on ``ModelArch`` (QKV bias,
Q/K RMSNorm, rope scaling, tied embeddings). Layers are stacked along a leading axis and run with
``lax.scan``: one compiled layer body instead of L copies keeps compile time flat in depth. When
``layers`` is instead a list of per-layer dicts (``weights.unstack_layers``), the layers are
unrolled: XLA:CPU copies a scanned layer's weights out of the stack each step, which costs more than
the compile time saved (EngineConfig.layer_loop).

Parameter tree (L layers, H hidden, F ffn, Hq/Hkv heads of D, V vocab); matrices are [in, out]:
    embed [V, H]; final_norm [H]; lm_head [H, V] (absent when tied)
    layers: input_norm [L, H], qkv [L, H, (Hq + 2*Hkv) * D], qkv_bias [L, (Hq+2Hkv)*D]?,
            q_norm / k_norm [L, D]?, o [L, Hq*D, H], o_bias [L, H]?, post_norm [L, H],
            gate_up [L, H, 2F], gate_up_bias [L, 2F]?, down [L, F, H], down_bias [L, H]?
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpuserve.attention.dispatch import AttentionParams, ragged_paged_attention
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.tpu_platform.models.arch import ModelArch


def rms_norm(x, weight, eps: float):
    """Normalise in f32 (as transformers does), scale in the activation dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def apply_rope(x, cos, sin):
    """Rotate-half rotary embedding. x [T, heads, D]; cos, sin [T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _layer(arch: ModelArch, attn_params: AttentionParams, attn_impl: str, md: AttentionMetadata,
           cos, sin, carry, layer_in):
    h, kv_cache = carry
    w, layer_idx = layer_in
    t = h.shape[0]
    hq, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim

    x = rms_norm(h, w["input_norm"], arch.rms_norm_eps)
    qkv = x @ w["qkv"]
    if "qkv_bias" in w:
        qkv = qkv + w["qkv_bias"]
    q = qkv[:, : hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
    if arch.qk_norm:
        q = rms_norm(q, w["q_norm"], arch.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], arch.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn, kv_cache = ragged_paged_attention(q, k, v, kv_cache, layer_idx, md, attn_params, attn_impl)
    out = attn.reshape(t, hq * d) @ w["o"]
    if "o_bias" in w:
        out = out + w["o_bias"]
    h = h + out

    x = rms_norm(h, w["post_norm"], arch.rms_norm_eps)
    gu = x @ w["gate_up"]
    if "gate_up_bias" in w:
        gu = gu + w["gate_up_bias"]
    f = arch.intermediate_size
    y = (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ w["down"]
    if "down_bias" in w:
        y = y + w["down_bias"]
    return (h + y, kv_cache), None


def forward(params, kv_cache, token_ids, positions, md: AttentionMetadata, logits_indices, *,
            arch: ModelArch, attn_impl: str, inv_freq):
    """One ragged step.

    token_ids, positions [T] i32; kv_cache [L, P, page_size, 2*Hkv, D]; logits_indices [R] i32.
    Returns (logits [R, V] f32, updated kv_cache).
    """
    h = params["embed"][token_ids]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    attn_params = AttentionParams(sm_scale=arch.head_dim ** -0.5, sliding_window=arch.sliding_window)
    layer_ids = jnp.arange(arch.num_layers, dtype=jnp.int32)

    def body(carry, layer_in):
        return _layer(arch, attn_params, attn_impl, md, cos, sin, carry, layer_in)

    if isinstance(params["layers"], (list, tuple)):  # unrolled: layer i is a constant
        carry = (h, kv_cache)
        for i, w in enumerate(params["layers"]):
            carry, _ = body(carry, (w, jnp.int32(i)))
        h, kv_cache = carry
    else:
        (h, kv_cache), _ = jax.lax.scan(body, (h, kv_cache), (params["layers"], layer_ids))
    h = rms_norm(h[logits_indices], params["final_norm"], arch.rms_norm_eps)
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    logits = jnp.dot(h, head, preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32), kv_cache

"""Draft heads for model-based speculation, in JAX: EAGLE-3 and MTP (their weights: loader/draft_head.py).

Both are one decoder block over a ragged batch with its own paged KV (one layer, the target's page
tables): a row at position q reads the embedding of token q+1 and a hidden state of position q, and
its output predicts token q+2. Fed the target's features it catches up with the verified tokens;
fed its own output (the "recycled" pre-norm hidden state) it drafts further, one token a step.

EAGLE-3 (vLLM's ``LlamaForCausalLMEagle3``):
    features = cat(residual streams entering target layers aux_layer_ids)     [T, A = 3*Ht]
    h = fc(features) the first time, the recycled output afterwards            [T, H]
    x = cat(input_norm(embed(t)), hidden_norm(h))  [T, 2H] -> attention (qkv over 2H),
    residual h (hidden_norm(h) with ``norm_before_residual``), post_norm, MLP -> out (pre-norm)
    logits = lm_head(norm(out)) over the draft vocabulary; target id = draft id + d2t[draft id]
MTP (DeepSeek-V3's, on a dense target we implement):
    features = the target's last hidden state after its final norm           [T, A = Ht]
    h = eh_proj(cat(enorm(embed(t)), hnorm(features or recycled)))  (embedding zeroed at position 0)
    out = block(h) (pre-norm); logits = shared_head.head(shared_head.norm(out)) over the full vocab

Param tree (H draft hidden, Hkv/G/D its attention, F its MLP, Vd its vocabulary):
    embed [V, H] (the target's when the checkpoint carries none); final_norm [H]; lm_head [H, Vd]
    layer: the decoder's per-layer dict (qkv [Hin, Hkv, G+2, D] with Hin = 2H for EAGLE-3, o, norms,
           gate and up [H, F] each (weights.unstack_layers), down)
    eagle3: fc [A, H], hidden_norm [H], d2t [Vd] i32        mtp: enorm [H], hnorm [H], eh_proj [2H, H]
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from tpuserve.attention.dispatch import AttentionParams
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.tpu_platform.linear import linear
from tpuserve.tpu_platform.models.arch import ModelArch
from tpuserve.tpu_platform.models.decoder import block_from_normed, rms_norm


@dataclass(frozen=True)
class DraftHead:
    """What a draft head is, statically (hashable: it lives in jit closures).

    method: "eagle3" | "mtp"; arch: the draft block's architecture (its attention, MLP and RoPE);
    aux_layer_ids: EAGLE-3's target layers whose incoming residual streams form the features (empty
    for MTP, whose feature is the target's final hidden state); feature_width: A;
    draft_vocab_size: Vd; norm_before_residual: EAGLE-3's variant that adds the normed hidden state.
    """

    method: str
    arch: ModelArch
    feature_width: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] = ()
    norm_before_residual: bool = False


def draft_forward(
    head: DraftHead,
    params,
    kv_cache,
    token_ids,
    positions,
    hidden,
    md: AttentionMetadata,
    *,
    attn_impl: str,
    inv_freq,
):
    """One draft step over a ragged batch.

    token_ids [T] i32: for a row at position q, token q+1; positions [T] i32: q;
    hidden [T, A] (target features: catch-up) or [T, H] (the head's own recycled output: drafting);
    kv_cache [1, P, page_size, C, D] (the head's own, attention/dispatch.py's layout).
    Returns (out [T, H] pre-norm output, kv_cache).
    """
    arch = head.arch
    eps = arch.rms_norm_eps
    embeds = params["embed"][token_ids]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    scale = arch.rope_attention_factor()  # YaRN's, as decoder.forward applies it; else 1
    cos, sin = jnp.cos(freqs) * scale, jnp.sin(freqs) * scale
    attn = AttentionParams(sm_scale=arch.head_dim**-0.5, sliding_window=arch.sliding_window)
    w = params["layer"]
    layer = jnp.int32(0)
    if head.method == "eagle3":
        # The width says which input this is: target features go through fc, recycled output not.
        h = linear(hidden, params["fc"]) if hidden.shape[-1] != arch.hidden_size else hidden
        normed = rms_norm(h, params["hidden_norm"], eps)
        x = jnp.concatenate([rms_norm(embeds, w["input_norm"], eps), normed], axis=-1)
        residual = normed if head.norm_before_residual else h
        return block_from_normed(arch, attn, attn_impl, md, cos, sin, x, residual, kv_cache, w, layer)
    # MTP: the first position has no previous token, so its embedding is zeroed (DeepSeek-V3).
    embeds = jnp.where((positions == 0)[:, None], jnp.zeros_like(embeds), embeds)
    x = jnp.concatenate(
        [rms_norm(embeds, params["enorm"], eps), rms_norm(hidden, params["hnorm"], eps)], axis=-1
    )
    h = linear(x, params["eh_proj"])
    return block_from_normed(
        arch, attn, attn_impl, md, cos, sin, rms_norm(h, w["input_norm"], eps), h, kv_cache, w, layer
    )


def draft_logits(params, out_rows, *, eps: float):
    """out_rows [R, H] pre-norm -> logits [R, Vd] f32 over the draft vocabulary."""
    return linear(
        rms_norm(out_rows, params["final_norm"], eps), params["lm_head"], out_dtype=jnp.float32
    ).astype(jnp.float32)


def to_target_ids(params, draft_ids):
    """Draft vocabulary ids -> target ids (EAGLE-3's d2t offsets; the identity without them)."""
    d2t = params.get("d2t")
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


def greedy_draft(head: DraftHead, params, out_rows):
    """out_rows [R, H] -> the draft's most likely next tokens [R] i32, as target ids."""
    logits = draft_logits(params, out_rows, eps=head.arch.rms_norm_eps)
    return to_target_ids(params, jnp.argmax(logits, axis=-1).astype(jnp.int32))

"""Tiny random decoders and ragged batches for decoder-level tests (no checkpoint, no tokenizer).

Weights start as Hugging Face-named [out, in] tensors and go through ``weights.build_params``, so
tests see exactly the layout the loaders produce.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.tpu_platform.models.arch import ModelArch
from tpuserve.tpu_platform.models.weights import build_params

PAGE_SIZE = 16
_ARCH_NAMES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def tiny_model(
    kind: str = "qwen2",
    *,
    layers: int = 3,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    ffn: int = 96,
    vocab: int = 128,
    tied: bool = False,
    seed: int = 0,
):
    """(arch, HF tensors {name: [out, in] f32}, stacked params f32) of a random ``kind`` model."""
    cfg = dict(
        architectures=[_ARCH_NAMES[kind]],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    arch = ModelArch.from_hf_config(cfg)
    rng = np.random.RandomState(seed)

    def w(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    q, kv = heads * head_dim, kv_heads * head_dim
    t = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0), "model.norm.weight": 1 + w(hidden)}
    if not tied:
        t["lm_head.weight"] = w(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update(
            {
                p + "self_attn.q_proj.weight": w(q, hidden),
                p + "self_attn.k_proj.weight": w(kv, hidden),
                p + "self_attn.v_proj.weight": w(kv, hidden),
                p + "self_attn.o_proj.weight": w(hidden, q),
                p + "mlp.gate_proj.weight": w(ffn, hidden),
                p + "mlp.up_proj.weight": w(ffn, hidden),
                p + "mlp.down_proj.weight": w(hidden, ffn),
                p + "input_layernorm.weight": 1 + w(hidden),
                p + "post_attention_layernorm.weight": 1 + w(hidden),
            }
        )
        if arch.qkv_bias:
            t.update(
                {
                    p + "self_attn.q_proj.bias": w(q),
                    p + "self_attn.k_proj.bias": w(kv),
                    p + "self_attn.v_proj.bias": w(kv),
                }
            )
        if arch.qk_norm:
            t.update(
                {
                    p + "self_attn.q_norm.weight": 1 + w(head_dim),
                    p + "self_attn.k_norm.weight": 1 + w(head_dim),
                }
            )
    return arch, t, build_params(arch, t.get, jnp.float32)


def ragged_step(arch: ModelArch, seq_lens, num_computed=None, *, num_pages: int = 16, seed: int = 1):
    """Inputs of one ragged step over len(seq_lens) sequences, each with its own 2 pages.

    Returns dict(token_ids [T], positions [T], md, logits_indices [S]) with T = sum(seq_lens) and
    S = len(seq_lens) (no padding: padding is the runner's business, not the decoder's).
    """
    num_computed = num_computed or [0] * len(seq_lens)
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, arch.vocab_size, sum(seq_lens)).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(num_computed, seq_lens)]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    kv_lens = np.asarray([c + n for c, n in zip(num_computed, seq_lens)], np.int32)
    assert (kv_lens <= 2 * PAGE_SIZE).all() and 1 + 2 * len(seq_lens) <= num_pages
    pages = (1 + np.arange(2 * len(seq_lens), dtype=np.int32)).reshape(-1, 2)  # page 0 stays unused
    md = AttentionMetadata(
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(pages),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(seq_lens)], jnp.int32),
    )
    return dict(
        token_ids=jnp.asarray(tokens),
        positions=jnp.asarray(positions),
        md=md,
        logits_indices=jnp.asarray(cu[1:] - 1),
    )


def empty_kv_cache(arch: ModelArch, num_pages: int = 16):
    """[L, P, page_size, 2*Hkv, D] zeros (f32)."""
    return jnp.zeros(
        (arch.num_layers, num_pages, PAGE_SIZE, 2 * arch.num_kv_heads, arch.head_dim), jnp.float32
    )

"""Random-weight draft checkpoints in the published layouts (no real small EAGLE-3 / MTP checkpoint
exists to download): an EAGLE-3 head directory, and a target directory with a DeepSeek-style MTP
layer appended."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file


def _w(rng, *shape, scale=0.1):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def write_eagle3(
    target_dir: str,
    out_dir: str,
    *,
    draft_vocab: int | None = None,
    aux_layer_ids=None,
    seed: int = 0,
    with_embed: bool = False,
) -> str:
    """An EAGLE-3 head for the model in ``target_dir`` (same hidden size), as the EAGLE trainer
    saves one: ``midlayer.*``, ``fc``, ``norm``, ``lm_head`` [Vd, H], ``d2t`` (offsets) and ``t2d``.
    draft_vocab: Vd < V picks Vd random target ids (sorted; d2t[i] = id_i - i)."""
    with open(os.path.join(target_dir, "config.json")) as f:
        tcfg = json.load(f)
    rng = np.random.default_rng(seed)
    h, v = tcfg["hidden_size"], tcfg["vocab_size"]
    heads, kv_heads, f = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["intermediate_size"]
    d = h // heads
    vd = draft_vocab or v
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": h,
        "intermediate_size": f,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": v,
        "draft_vocab_size": vd,
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "target_hidden_size": h,
    }
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    t = {
        "midlayer.self_attn.q_proj.weight": _w(rng, heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": _w(rng, kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": _w(rng, kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": _w(rng, h, heads * d),
        "midlayer.mlp.gate_proj.weight": _w(rng, f, h),
        "midlayer.mlp.up_proj.weight": _w(rng, f, h),
        "midlayer.mlp.down_proj.weight": _w(rng, h, f),
        "midlayer.input_layernorm.weight": 1 + _w(rng, h),
        "midlayer.hidden_norm.weight": 1 + _w(rng, h),
        "midlayer.post_attention_layernorm.weight": 1 + _w(rng, h),
        "fc.weight": _w(rng, h, 3 * h),
        "norm.weight": 1 + _w(rng, h),
        "lm_head.weight": _w(rng, vd, h, scale=0.5),
    }
    if vd < v:
        used = np.sort(rng.choice(v, vd, replace=False))
        t["d2t"] = (used - np.arange(vd)).astype(np.int64)
        t2d = np.zeros(v, bool)
        t2d[used] = True
        t["t2d"] = t2d
    if with_embed:
        t["embed_tokens.weight"] = _w(rng, v, h)
    os.makedirs(out_dir, exist_ok=True)
    save_file(t, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


def with_mtp_layer(target_dir: str, out_dir: str, *, seed: int = 0, own_head: bool = True) -> str:
    """A copy of ``target_dir`` carrying one MTP layer at ``model.layers.{L}`` (DeepSeek-V3's names:
    enorm, hnorm, eh_proj, shared_head.{norm, head}, and a decoder block) and
    ``num_nextn_predict_layers: 1`` in its config."""
    shutil.copytree(target_dir, out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    rng = np.random.default_rng(seed)
    h, v, f_ = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    p = f"model.layers.{cfg['num_hidden_layers']}."
    t = {
        p + "enorm.weight": 1 + _w(rng, h),
        p + "hnorm.weight": 1 + _w(rng, h),
        p + "eh_proj.weight": _w(rng, h, 2 * h),
        p + "self_attn.q_proj.weight": _w(rng, heads * d, h),
        p + "self_attn.k_proj.weight": _w(rng, kv_heads * d, h),
        p + "self_attn.v_proj.weight": _w(rng, kv_heads * d, h),
        p + "self_attn.o_proj.weight": _w(rng, h, heads * d),
        p + "mlp.gate_proj.weight": _w(rng, f_, h),
        p + "mlp.up_proj.weight": _w(rng, f_, h),
        p + "mlp.down_proj.weight": _w(rng, h, f_),
        p + "input_layernorm.weight": 1 + _w(rng, h),
        p + "post_attention_layernorm.weight": 1 + _w(rng, h),
        p + "shared_head.norm.weight": 1 + _w(rng, h),
    }
    if cfg.get("attention_bias"):
        for n, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
            t[p + f"self_attn.{n}_proj.bias"] = _w(rng, rows)
    if own_head:
        t[p + "shared_head.head.weight"] = _w(rng, v, h, scale=0.5)
    save_file(t, os.path.join(out_dir, "mtp.safetensors"))
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir

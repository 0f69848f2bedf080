"""A shape-only gpt-oss-20b model directory (config.json, tokenizer files, shapes.json, dtypes.json)
for ``benchmarks/random_checkpoint.py --like``: openai/gpt-oss-20b's published config (hidden 2880,
64 q / 8 KV heads of 64, 32 experts of 2880, top-4, sliding window 128 on every other layer,
attention sinks, YaRN x32) with its experts as the published MXFP4 ``*_blocks`` / ``*_scales`` (u8),
the rest bf16 in the real checkpoint (the random one writes them in --dtype).

The vocabulary is the published 201088 (``--vocab``): the embedding and LM head are 2 x 201088 x
2880 bf16 = 2.3 GB, a sixth of the model, so a smaller one would flatter both the fit and the
decode roofline. The tokenizer is the small one every shape dir shares (moe_shape.py); a random
model's ids past its 49152 decode to nothing, which a timing run does not read. ``--layers`` keeps the first
N layers (the published 24 by default), so a fewer-layer variant fits a short device call.
Tensor names are the ones transformers saves (from a tiny model of the same config), with each
expert projection's dense name replaced by its ``_blocks`` and ``_scales``.

    python benchmarks/gpt_oss_shape.py TOKENIZER_DIR .tpu_carry/shapes/gpt-oss-20b-24l --layers 24
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile

from moe_shape import TOKENIZER_FILES  # benchmarks/moe_shape.py

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2880, 64, 8, 64
EXPERTS, TOP_K, EXPERT_FFN = 32, 4, 2880
MXFP4_BLOCK = 32


def published_config(vocab: int, layers: int, bos: int | None, eos: int | None) -> dict:
    """openai/gpt-oss-20b's config.json fields, with this vocabulary and layer count."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": EXPERT_FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "experts_per_token": TOP_K,
        "sliding_window": 128,
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        "rope_theta": 150000,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initial_context_length": 4096,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "use_cache": True,
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
    }


def dense_names(layers: int) -> list[str]:
    """Tensor names of a transformers-saved GptOssForCausalLM with ``layers`` layers (tiny widths)."""
    import transformers
    from safetensors import safe_open

    cfg = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        tie_word_embeddings=False,
    )
    names: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        transformers.GptOssForCausalLM(cfg).save_pretrained(d)
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "np") as g:
                    names += list(g.keys())
    return names


def shapes_and_dtypes(names: list[str], vocab: int) -> tuple[dict[str, list[int]], dict[str, str]]:
    """(name -> shape, name -> "U8" for the packed expert tensors) in the published layout."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    # expert projection -> (out, in) of the published [E, out, in/32, 16] blocks
    experts = {"gate_up_proj": (2 * EXPERT_FFN, HIDDEN), "down_proj": (HIDDEN, EXPERT_FFN)}
    rules = {
        "embed_tokens.weight": [vocab, HIDDEN],
        "lm_head.weight": [vocab, HIDDEN],
        "norm.weight": [HIDDEN],  # every RMSNorm: input, post-attention, final
        "q_proj.weight": [q, HIDDEN],
        "q_proj.bias": [q],
        "k_proj.weight": [kv, HIDDEN],
        "k_proj.bias": [kv],
        "v_proj.weight": [kv, HIDDEN],
        "v_proj.bias": [kv],
        "o_proj.weight": [HIDDEN, q],
        "o_proj.bias": [HIDDEN],
        "self_attn.sinks": [HEADS],
        "router.weight": [EXPERTS, HIDDEN],
        "router.bias": [EXPERTS],
        "gate_up_proj_bias": [EXPERTS, 2 * EXPERT_FFN],
        "down_proj_bias": [EXPERTS, HIDDEN],
    }
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    for name in names:
        proj = name.rsplit(".", 1)[-1]
        if proj in experts:  # the dense [E, in, out] -> the published blocks and scales
            out, k = experts[proj]
            shapes[name + "_blocks"] = [EXPERTS, out, k // MXFP4_BLOCK, MXFP4_BLOCK // 2]
            shapes[name + "_scales"] = [EXPERTS, out, k // MXFP4_BLOCK]
            dtypes[name + "_blocks"] = dtypes[name + "_scales"] = "U8"
            continue
        rule = next((v for k, v in rules.items() if name.endswith(k)), None)
        if rule is None:
            raise SystemExit(f"no shape rule for {name}")
        shapes[name] = rule
    return shapes, dtypes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer_dir", help="an HF directory with config.json and tokenizer files")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=201088, help="0: the tokenizer directory's")
    args = ap.parse_args()

    base = json.load(open(os.path.join(args.tokenizer_dir, "config.json")))
    vocab = args.vocab or int(base["vocab_size"])
    shapes, dtypes = shapes_and_dtypes(dense_names(args.layers), vocab)
    os.makedirs(args.out, exist_ok=True)
    config = published_config(vocab, args.layers, base.get("bos_token_id"), base.get("eos_token_id"))
    for name, data in (("config.json", config), ("shapes.json", shapes), ("dtypes.json", dtypes)):
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(data, f, indent=1 if name == "config.json" else None)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(args.tokenizer_dir, name)):
            shutil.copy(os.path.join(args.tokenizer_dir, name), args.out)
    dense = sum(math.prod(v) for n, v in shapes.items() if n not in dtypes)
    packed = sum(math.prod(v) for n, v in shapes.items() if n in dtypes)
    experts = sum(math.prod(v) * 2 for n, v in shapes.items() if n.endswith("_blocks"))  # 2 a byte
    print(
        f"{args.out}: {(dense + experts) / 1e9:.2f} B parameters, {experts / 1e9:.2f} B of them "
        f"experts in {packed / 2**30:.2f} GiB of MXFP4 bytes"
    )


if __name__ == "__main__":
    main()

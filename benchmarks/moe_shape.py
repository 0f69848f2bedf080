"""A shape-only Qwen3-MoE model directory (config.json, tokenizer files, shapes.json) for
``benchmarks/random_checkpoint.py --like``: Qwen3-30B-A3B's layer (hidden 2048, 32 q / 4 KV heads of
128, 128 experts of 768, top-8) with fewer layers, and the vocabulary of the tokenizer directory
given, so one small tokenizer serves. Tensor names are the ones transformers saves (the published
per-expert names), read from a tiny model of the same config.

    python benchmarks/moe_shape.py TOKENIZER_DIR .tpu_carry/shapes/qwen3-moe-30b-a3b-4l --layers 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer_dir", help="an HF directory with config.json and tokenizer files")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()

    import transformers
    from safetensors import safe_open

    base = json.load(open(os.path.join(args.tokenizer_dir, "config.json")))
    hidden, heads, kv_heads, head_dim, experts, expert_ffn = 2048, 32, 4, 128, 128, 768
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=base["vocab_size"],
        hidden_size=hidden,
        intermediate_size=6144,
        moe_intermediate_size=expert_ffn,
        num_experts=experts,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
    )
    # The names only: a tiny model of the same layout, saved as transformers saves it.
    tiny = dict(cfg.to_dict(), hidden_size=64, intermediate_size=16, moe_intermediate_size=8)
    tiny.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64)
    names: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**tiny)).save_pretrained(d)
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "np") as g:
                    names += list(g.keys())

    def shape(name: str) -> list[int]:
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return [cfg.vocab_size, hidden]
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            return [head_dim]
        if name.endswith("norm.weight"):
            return [hidden]
        for proj, out_dim in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim)):
            if proj in name:
                return [out_dim, hidden]
        if "v_proj" in name:
            return [kv_heads * head_dim, hidden]
        if "o_proj" in name:
            return [hidden, heads * head_dim]
        if name.endswith("mlp.gate.weight"):  # the router
            return [experts, hidden]
        if "gate_proj" in name or "up_proj" in name:
            return [expert_ffn, hidden]
        if "down_proj" in name:
            return [hidden, expert_ffn]
        raise SystemExit(f"no shape rule for {name}")

    shapes = {n: shape(n) for n in names}
    os.makedirs(args.out, exist_ok=True)
    config = cfg.to_dict()
    config.pop("dtype", None)
    config.update(architectures=["Qwen3MoeForCausalLM"], torch_dtype="bfloat16")
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(args.out, "shapes.json"), "w") as f:
        json.dump(shapes, f)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(args.tokenizer_dir, name)):
            shutil.copy(os.path.join(args.tokenizer_dir, name), args.out)
    print(f"{args.out}: {sum(math.prod(v) for v in shapes.values()) / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()

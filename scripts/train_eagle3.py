"""Train a small EAGLE-3 draft head for a model on this CPU, in minutes, and measure its acceptance.

    python scripts/train_eagle3.py --out /tmp/eagle3-smollm2            # the default model
    python scripts/train_eagle3.py --model HF_DIR --out DIR --steps 300

1. Data (self-distillation, no download): prompts built from the docstrings of Python's standard
   library (explain / repeat / continue a passage), answered greedily by the target with our engine.
2. Features: one target prefill per sequence with the EAGLE-3 feature layers (2, L//2, L-3).
3. Training (JAX, Adam): the head sees (token q+1, features of q) and predicts token q+2; with
   ``--ttt-steps`` > 1 it is also trained on its own recycled output, attending as it will when
   drafting (training-time test: step s at row q sees step 0's keys up to q and its own earlier
   steps' keys at q).
4. Saves the published layout (config.json, model.safetensors: midlayer.*, fc, norm, lm_head, d2t,
   t2d) and loads it back through ``--speculative-config '{"method": "eagle3", ...}'`` on held-out
   prompts, printing acceptance length and decode speed against the plain engine.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pydoc
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def passages(n: int, seed: int = 0) -> list[str]:
    """n stdlib docstrings of 200-1200 characters (local English text)."""
    import importlib

    mods = [
        "os",
        "json",
        "re",
        "collections",
        "itertools",
        "functools",
        "argparse",
        "pathlib",
        "subprocess",
        "threading",
        "logging",
        "datetime",
        "random",
        "statistics",
        "textwrap",
        "string",
        "heapq",
        "bisect",
        "shutil",
        "tempfile",
        "csv",
        "email",
        "http.client",
        "urllib.parse",
        "unittest",
        "asyncio",
        "socket",
        "typing",
        "dataclasses",
        "decimal",
    ]
    docs = []
    for name in mods:
        mod = importlib.import_module(name)
        for _, obj in inspect.getmembers(mod):
            d = inspect.getdoc(obj) if (inspect.isfunction(obj) or inspect.isclass(obj)) else None
            if d and 200 <= len(d) <= 1200 and d not in docs:
                docs.append(pydoc.plain(d))
    rng = np.random.default_rng(seed)
    rng.shuffle(docs)
    return docs[:n]


TASKS = [
    "Explain in plain words what this documentation says:\n\n{p}",
    "Repeat the following text exactly:\n\n{p}",
    "Summarize this in three sentences:\n\n{p}",
    "Rewrite this documentation as a short tutorial:\n\n{p}",
]


def chat_prompts(tok, texts: list[str], offset: int = 0) -> list[list[int]]:
    out = []
    for i, t in enumerate(texts):
        msg = [{"role": "user", "content": TASKS[(i + offset) % len(TASKS)].format(p=t)}]
        text = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


# ---- the head, dense, for training (the same definition as tpu_platform/models/draft_head.py) ----


def init_head(rng, h: int, a: int, heads: int, kv_heads: int, d: int, f: int, vd: int, embed):
    def w(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return {
        "q": w(2 * h, heads * d, scale=(2 * h) ** -0.5),
        "k": w(2 * h, kv_heads * d, scale=(2 * h) ** -0.5),
        "v": w(2 * h, kv_heads * d, scale=(2 * h) ** -0.5),
        "o": w(heads * d, h, scale=(heads * d) ** -0.5),
        "gate": w(h, f, scale=h**-0.5),
        "up": w(h, f, scale=h**-0.5),
        "down": w(f, h, scale=f**-0.5),
        "input_norm": np.ones(h, np.float32),
        "hidden_norm": np.ones(h, np.float32),
        "post_norm": np.ones(h, np.float32),
        "norm": np.ones(h, np.float32),
        "fc": w(a, h, scale=a**-0.5),
        # Start the head from the target's own embedding rows of the draft vocabulary.
        "lm_head": np.ascontiguousarray(embed.T).astype(np.float32),
    }


def make_loss(heads: int, kv_heads: int, d: int, eps: float, inv_freq, ttt_steps: int):
    import jax
    import jax.numpy as jnp

    from tpuserve.tpu_platform.models.decoder import apply_rope, rms_norm

    def qkv(p, x, pos):
        n = x.shape[0]
        q = apply_rope((x @ p["q"]).reshape(n, heads, d), *rope(pos))
        k = apply_rope((x @ p["k"]).reshape(n, kv_heads, d), *rope(pos))
        v = (x @ p["v"]).reshape(n, kv_heads, d)
        return q, jnp.repeat(k, heads // kv_heads, 1), jnp.repeat(v, heads // kv_heads, 1)

    def rope(pos):
        f = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]
        return jnp.cos(f), jnp.sin(f)

    def seq_loss(p, embed, feats, tokens, labels, mask):
        """One sequence: feats [N, A], tokens [N] (token q+1), labels [ttt, N] draft ids (-1: none)."""
        n = tokens.shape[0]
        pos = jnp.arange(n)
        h = feats @ p["fc"]
        keys, vals = [], []
        total, count = 0.0, 0.0
        tok = tokens
        for s in range(ttt_steps):
            e = embed[tok]
            x = jnp.concatenate([rms_norm(e, p["input_norm"], eps), rms_norm(h, p["hidden_norm"], eps)], -1)
            q, k, v = qkv(p, x, pos + s)
            keys.append(k)
            vals.append(v)
            # Step 0: causal over step 0's keys. Step s: those, plus each later step's key of the same row.
            sc = jnp.einsum("qhd,khd->hqk", q, keys[0]) * d**-0.5
            sc = jnp.where(pos[None, None, :] <= pos[None, :, None], sc, -1e30)
            diag = [jnp.einsum("qhd,qhd->hq", q, kk)[..., None] * d**-0.5 for kk in keys[1:]]
            allsc = jnp.concatenate([sc] + diag, -1)
            pr = jax.nn.softmax(allsc, -1)
            out = jnp.einsum("hqk,khd->qhd", pr[..., :n], vals[0])
            for j, vv in enumerate(vals[1:]):
                out = out + pr[..., n + j].T[:, :, None] * vv
            hh = h + out.reshape(n, heads * d) @ p["o"]
            y = rms_norm(hh, p["post_norm"], eps)
            hh = hh + (jax.nn.silu(y @ p["gate"]) * (y @ p["up"])) @ p["down"]
            logits = rms_norm(hh, p["norm"], eps) @ p["lm_head"]
            lab = labels[s]
            ok = (lab >= 0) & mask
            lp = jax.nn.log_softmax(logits, -1)
            nll = -jnp.take_along_axis(lp, jnp.maximum(lab, 0)[:, None], 1)[:, 0]
            total = total + jnp.sum(jnp.where(ok, nll, 0.0)) * (0.8**s)
            count = count + jnp.sum(ok) * (0.8**s)
            # Next step: row q drafts from its own output, reading token q+2+s (teacher forcing).
            h = hh
            tok = jnp.concatenate([tokens[s + 1 :], jnp.zeros(s + 1, tokens.dtype)])
        return total, count

    def loss(p, embed, feats, tokens, labels, mask):
        tot, cnt = jax.vmap(seq_loss, in_axes=(None, None, 0, 0, 0, 0))(p, embed, feats, tokens, labels, mask)
        return jnp.sum(tot) / jnp.maximum(jnp.sum(cnt), 1.0)

    return loss


def adam_step(p, g, m, v, t, lr, b1=0.9, b2=0.95, eps=1e-8):
    import jax
    import jax.numpy as jnp

    m = jax.tree.map(lambda a, b: b1 * a + (1 - b1) * b, m, g)
    v = jax.tree.map(lambda a, b: b2 * a + (1 - b2) * b * b, v, g)
    p = jax.tree.map(
        lambda w_, a, b: w_ - lr * (a / (1 - b1**t)) / (jnp.sqrt(b / (1 - b2**t)) + eps), p, m, v
    )
    return p, m, v


def save_head(out: str, p, cfg: dict, used: np.ndarray, vocab: int) -> None:
    from safetensors.numpy import save_file

    a = {k: np.asarray(v, np.float32) for k, v in p.items()}
    t = {
        "midlayer.self_attn.q_proj.weight": a["q"].T,
        "midlayer.self_attn.k_proj.weight": a["k"].T,
        "midlayer.self_attn.v_proj.weight": a["v"].T,
        "midlayer.self_attn.o_proj.weight": a["o"].T,
        "midlayer.mlp.gate_proj.weight": a["gate"].T,
        "midlayer.mlp.up_proj.weight": a["up"].T,
        "midlayer.mlp.down_proj.weight": a["down"].T,
        "midlayer.input_layernorm.weight": a["input_norm"],
        "midlayer.hidden_norm.weight": a["hidden_norm"],
        "midlayer.post_attention_layernorm.weight": a["post_norm"],
        "norm.weight": a["norm"],
        "fc.weight": a["fc"].T,
        "lm_head.weight": a["lm_head"].T,
        "d2t": (used - np.arange(len(used))).astype(np.int64),
    }
    t2d = np.zeros(vocab, bool)
    t2d[used] = True
    t["t2d"] = t2d
    os.makedirs(out, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target HF dir (default: SmolLM2-135M-Instruct from its GGUF)")
    ap.add_argument("--out", required=True, help="where to write the EAGLE-3 checkpoint")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=320, help="training rows per sequence (cut/padded)")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--intermediate-size", type=int, default=768)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ttt-steps", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=6)
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import transformers

    from tpuserve import LLM, SamplingParams
    from tpuserve.tpu_platform.config import EngineConfig
    from tpuserve.tpu_platform.device import discover
    from tpuserve.tpu_platform.loader import load_model
    from tpuserve.tpu_platform.loader.draft_head import default_aux_layer_ids
    from tpuserve.tpu_platform.loader.export import default_model_hf_dir
    from tpuserve.tpu_platform.model_runner import ModelRunner
    from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

    t_start = time.perf_counter()
    model = args.model or default_model_hf_dir()
    tok = transformers.AutoTokenizer.from_pretrained(model)
    texts = passages(args.num_prompts + args.eval_prompts)
    train_texts, eval_texts = texts[: args.num_prompts], texts[args.num_prompts :]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens)

    # 1. data: the target's own greedy answers
    t0 = time.perf_counter()
    llm = LLM(model, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512)
    prompts = chat_prompts(tok, train_texts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    gen_s = time.perf_counter() - t0
    print(f"data: {len(seqs)} sequences, {sum(map(len, seqs))} tokens, generated in {gen_s:.0f} s")

    del llm

    # 2. features: a runner whose forward also returns the EAGLE-3 feature layers
    t0 = time.perf_counter()
    loaded = load_model(model, jnp.float32)
    arch = loaded.arch
    aux = default_aux_layer_ids(arch.num_layers)
    config = EngineConfig.from_kwargs(model=model, max_num_batched_tokens=512, max_num_seqs=1)
    runner = ModelRunner(
        config,
        arch,
        loaded.params,
        discover(),
        jnp.float32,
        num_pages=40,
        max_model_len=1024,
        draft_aux_layers=aux,
    )
    embed = np.asarray(loaded.params["embed"], np.float32)
    del loaded
    n_rows = args.seq_len
    feats = np.zeros((len(seqs), n_rows, len(aux) * arch.hidden_size), np.float32)
    for i, s in enumerate(seqs):
        s = s[: n_rows + 1 + args.ttt_steps]  # most sequences: one token bucket, one compile
        n = len(s)
        pages = list(range(1, -(-n // runner.page_size) + 1))
        fwd = runner.forward(runner.build_batch([ScheduledSeq(s[:n], 0, pages, SamplingRow())]))
        f = np.asarray(fwd.features)[:n]
        feats[i, : min(n, n_rows)] = f[:n_rows]
    print(f"features: {feats.shape} in {time.perf_counter() - t0:.0f} s")

    # draft vocabulary: the most frequent target tokens of the data
    counts = np.bincount(np.concatenate([np.asarray(s) for s in seqs]), minlength=arch.vocab_size)
    used = np.sort(np.argsort(-counts, kind="stable")[: args.draft_vocab])
    t2d_index = np.full(arch.vocab_size, -1, np.int64)
    t2d_index[used] = np.arange(len(used))
    tokens = np.zeros((len(seqs), n_rows), np.int32)
    labels = np.full((len(seqs), args.ttt_steps, n_rows), -1, np.int32)
    mask = np.zeros((len(seqs), n_rows), bool)
    for i, s in enumerate(seqs):
        s = np.asarray(s)
        n = min(len(s) - 1, n_rows)
        tokens[i, :n] = s[1 : n + 1]
        mask[i, :n] = True
        for st in range(args.ttt_steps):
            lab = s[2 + st : n + 2 + st]
            labels[i, st, : len(lab)] = t2d_index[lab]
    coverage = float((labels[:, 0][mask] >= 0).mean())
    print(f"draft vocabulary {len(used)}: covers {coverage:.1%} of the label tokens")

    # 3. training
    del runner
    h, d = arch.hidden_size, arch.head_dim
    head_inv = arch.inv_freq()
    rng = np.random.default_rng(0)
    p = init_head(
        rng,
        h,
        len(aux) * h,
        arch.num_heads,
        arch.num_kv_heads,
        d,
        args.intermediate_size,
        len(used),
        embed[used],
    )
    p = jax.tree.map(jnp.asarray, p)
    loss = make_loss(
        arch.num_heads, arch.num_kv_heads, d, arch.rms_norm_eps, jnp.asarray(head_inv), args.ttt_steps
    )
    grad = jax.jit(jax.value_and_grad(loss))
    m = jax.tree.map(jnp.zeros_like, p)
    v = jax.tree.map(jnp.zeros_like, p)
    step = jax.jit(adam_step, static_argnames=())
    emb = jnp.asarray(embed)
    t0 = time.perf_counter()
    for it in range(1, args.steps + 1):
        idx = rng.choice(len(seqs), args.batch, replace=False)
        lr = args.lr * min(1.0, it / 20) * (0.1 + 0.9 * (1 - it / args.steps))
        val, g = grad(
            p,
            emb,
            jnp.asarray(feats[idx]),
            jnp.asarray(tokens[idx]),
            jnp.asarray(labels[idx]),
            jnp.asarray(mask[idx]),
        )
        p, m, v = step(p, g, m, v, it, lr)
        if it == 1 or it % 25 == 0 or it == args.steps:
            print(f"  step {it}/{args.steps}: loss {float(val):.3f} ({time.perf_counter() - t0:.0f} s)")
    train_s = time.perf_counter() - t0

    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": h,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": d,
        "vocab_size": arch.vocab_size,
        "draft_vocab_size": len(used),
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "tie_word_embeddings": False,
        "target_hidden_size": h,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True},
    }
    save_head(args.out, p, cfg, used, arch.vocab_size)
    print(f"saved {args.out}")

    # 4. acceptance on held-out prompts, through the engine
    eval_ids = chat_prompts(tok, eval_texts, offset=1)
    eval_params = SamplingParams(temperature=0.0, max_tokens=args.eval_tokens, ignore_eos=True)
    k = args.num_speculative_tokens
    results = {}
    for name, spec in (
        ("plain", None),
        ("eagle3", {"method": "eagle3", "model": args.out, "num_speculative_tokens": k}),
    ):
        eng = LLM(
            model, max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=512, speculative_config=spec
        )
        for ids in eval_ids:  # compiles the shapes the timed pass uses (cheaper than a full warm-up)
            eng.generate([{"prompt_token_ids": ids}], eval_params, use_tqdm=False)
        st = eng.engine.stats
        d0, a0 = st.spec_num_drafts, st.spec_num_accepted_tokens
        pos0 = list(st.spec_accepted_per_pos)
        t0 = time.perf_counter()
        toks = []
        for ids in eval_ids:
            o = eng.generate([{"prompt_token_ids": ids}], eval_params, use_tqdm=False)[0]
            toks.append(o.outputs[0].token_ids)
        wall = time.perf_counter() - t0
        results[name] = {"tok_s": sum(map(len, toks)) / wall, "tokens": toks}
        if spec:
            nd, na = st.spec_num_drafts - d0, st.spec_num_accepted_tokens - a0
            results[name]["acceptance_length"] = 1 + na / max(nd, 1)
            results[name]["per_position"] = [b - a for a, b in zip(pos0, st.spec_accepted_per_pos)]
        del eng
    same = results["plain"]["tokens"] == results["eagle3"]["tokens"]
    speed = results["eagle3"]["tok_s"] / results["plain"]["tok_s"]
    summary = {
        "model": model,
        "train_sequences": len(seqs),
        "train_tokens": int(mask.sum()),
        "steps": args.steps,
        "ttt_steps": args.ttt_steps,
        "draft_vocab": len(used),
        "generate_s": round(gen_s, 1),
        "train_s": round(train_s, 1),
        "total_s": round(time.perf_counter() - t_start, 1),
        "k": k,
        "acceptance_length": round(results["eagle3"]["acceptance_length"], 3),
        "accepted_per_position": results["eagle3"]["per_position"],
        "plain_tok_s": round(results["plain"]["tok_s"], 2),
        "eagle3_tok_s": round(results["eagle3"]["tok_s"], 2),
        "eagle3_over_plain": round(speed, 3),
        "greedy_identical": same,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

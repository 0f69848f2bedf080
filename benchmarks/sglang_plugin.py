"""Offline throughput: SGLang (its scheduler + radix cache) on our JAX runtime vs our standalone engine.

Same run, same weights (the default model exported to a Hugging Face directory), same prompt token
ids, greedy, ``ignore_eos`` so every request produces exactly ``--max-tokens`` tokens:
  * SGLang 0.5.23's offline ``sglang.Engine`` with the tpuserve platform (SGLANG_PLATFORM=tpuserve):
    its scheduler drives our executor through the plugin,
  * tpuserve's own ``LLM.generate``,
  * with ``--ngram N``, also SGLang's engine with ``--speculative-algorithm NGRAM`` and N tokens a
    verify (its corpus drafts, our runner verifies), and the ratio to SGLang without it.
Each side runs in its own subprocess (one JAX owner at a time: a TPU admits one process), does one
warm-up pass (compiles), then ``--repeats`` timed passes. Every pass uses a fresh prompt set - the
same sets for both sides - so neither the radix cache nor our prefix cache replays a previous
pass. Prints output tokens/s per side (median pass) and the ratio. Run with the SGLang venv:

    "$(bash scripts/sglang_env.sh)" benchmarks/sglang_plugin.py --num-prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TOPICS = [
    "the history of Rome",
    "how rainbows form",
    "a recipe for bread",
    "why the sky is blue",
    "the rules of chess",
    "how vaccines work",
    "the water cycle",
    "black holes",
    "learning to play the piano",
    "the French revolution",
    "photosynthesis",
    "how a CPU works",
    "the life of bees",
    "volcanoes",
    "the origin of the internet",
    "coral reefs",
]
OPENERS = [
    "Write a short paragraph about",
    "Explain in simple words",
    "Tell a child about",
    "Give three facts about",
    "Describe",
]


def prompt_sets(num_sets: int, n: int) -> list[list[str]]:
    """Distinct prompt sets (set 0 warms up); within a set, lengths vary a little."""
    return [
        [
            f"{OPENERS[s % len(OPENERS)]} {TOPICS[i % len(TOPICS)]}"
            + " in detail" * (i % 5)
            + f" (version {s})."
            for i in range(n)
        ]
        for s in range(num_sets)
    ]


def run_sglang(job: dict) -> list[dict]:
    os.environ["SGLANG_PLATFORM"] = "tpuserve"  # before SGLang's import picks its platform
    import sglang

    spec = {}
    if job.get("ngram"):
        spec = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": job["ngram"]}
    engine = sglang.Engine(
        model_path=job["hf_dir"],
        max_total_tokens=job["max_total_tokens"],
        skip_server_warmup=True,
        log_level="error",
        **spec,
    )
    params = {"temperature": 0.0, "max_new_tokens": job["max_tokens"], "ignore_eos": True}
    passes = []
    try:
        for ids in job["sets"]:
            t = time.perf_counter()
            outs = engine.generate(input_ids=ids, sampling_params=params)
            passes.append(
                {
                    "seconds": time.perf_counter() - t,
                    "tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
                    # model calls that produced them (0 without speculation: one a token)
                    "verifies": sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs),
                }
            )
    finally:
        engine.shutdown()
    return passes


def run_ours(job: dict) -> list[dict]:
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    # The settings the plugin gives SGLang: 16-token pages, 256-token steps, 32 sequences.
    llm = LLM(job["hf_dir"], max_num_seqs=32, max_num_batched_tokens=256, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    passes = []
    for ids in job["sets"]:
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        passes.append(
            {"seconds": time.perf_counter() - t, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
        )
    return passes


def child(side: str, job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    if side == "sglang_ngram":
        job = {**job, "ngram": job["ngram_tokens"]}
    passes = run_ours(job) if side == "ours" else run_sglang(job)
    print("RESULT " + json.dumps(passes), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-total-tokens", type=int, default=4096, help="SGLang's KV pool (tokens)")
    ap.add_argument(
        "--ngram", type=int, default=0, help="also run SGLang with NGRAM speculation, N tokens a verify"
    )
    ap.add_argument("--child", choices=["sglang", "sglang_ngram", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.job)
        return

    from transformers import AutoTokenizer

    from tpuserve.tpu_platform.loader.export import default_model_hf_dir

    hf_dir = default_model_hf_dir()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    sets = [[tok.encode(p) for p in s] for s in prompt_sets(1 + args.repeats, args.num_prompts)]
    need = args.num_prompts * (max(len(p) for s in sets for p in s) + args.max_tokens + 16)
    if need > args.max_total_tokens:
        sys.exit(
            f"--max-total-tokens {args.max_total_tokens} cannot hold {args.num_prompts} "
            f"requests at once (~{need} tokens); raise it or lower --num-prompts"
        )
    job = {
        "hf_dir": hf_dir,
        "sets": sets,
        "max_tokens": args.max_tokens,
        "max_total_tokens": args.max_total_tokens,
        "ngram_tokens": args.ngram,
    }
    sides = ("sglang", "ours") + (("sglang_ngram",) if args.ngram else ())
    results = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        for side in sides:
            env = dict(os.environ)
            t = time.perf_counter()
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", side, "--job", f.name],
                capture_output=True,
                text=True,
                env=env,
                timeout=3600,
            )
            if out.returncode != 0:
                sys.exit(f"{side} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
            passes = json.loads(line[len("RESULT ") :])
            timed = passes[1:]  # pass 0 warms up (compiles)
            tps = statistics.median(p["tokens"] / p["seconds"] for p in timed)
            results[side] = {
                "tok_per_s": tps,
                "warmup_s": passes[0]["seconds"],
                "pass_s": [round(p["seconds"], 2) for p in timed],
                "tokens_per_pass": timed[0]["tokens"],
                "tokens_per_verify": (
                    round(timed[0]["tokens"] / timed[0]["verifies"], 2) if timed[0].get("verifies") else None
                ),
                "wall_s_incl_startup": time.perf_counter() - t,
            }
    finally:
        os.unlink(f.name)
    print(
        f"{args.num_prompts} prompts x {args.max_tokens} tokens, greedy, median of "
        f"{args.repeats} passes after a warm-up"
    )
    for side, name in (("sglang", "SGLang + tpuserve plugin"), ("ours", "tpuserve standalone")):
        r = results[side]
        print(
            f"  {name:26s} {r['tok_per_s']:8.1f} output tok/s  (passes {r['pass_s']} s, "
            f"warm-up {r['warmup_s']:.1f} s, process {r['wall_s_incl_startup']:.0f} s)"
        )
    ratio = results["sglang"]["tok_per_s"] / results["ours"]["tok_per_s"]
    print(f"  ratio SGLang+plugin / standalone: {ratio:.2f}")
    if args.ngram:
        r = results["sglang_ngram"]
        print(
            f"  {'SGLang + plugin, NGRAM':26s} {r['tok_per_s']:8.1f} output tok/s  (passes {r['pass_s']} s, "
            f"{r['tokens_per_verify']} tokens a verify)"
        )
        print(f"  ratio NGRAM / no speculation: {r['tok_per_s'] / results['sglang']['tok_per_s']:.2f}")
    print("JSON " + json.dumps({"num_prompts": args.num_prompts, "max_tokens": args.max_tokens, **results}))


if __name__ == "__main__":
    main()

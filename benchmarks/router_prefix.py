"""``tpuserve router`` policies compared: N ``tpuserve serve`` replicas of a tiny random model on
localhost, a workload of K groups of requests sharing long system prompts sent through a router of
each policy (fresh replicas per policy, so no cache carries over); prints each policy's prefix-cache
hit rate (the replicas' ``vllm:prefix_cache_*`` counters) and TTFT median / p90.

    python benchmarks/router_prefix.py --replicas 4 --groups 8 --per-group 6
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv

SMOL = os.path.expanduser("~/.cache/tpuserve/models/SmolLM2-135M-Instruct")


def tiny_checkpoint(out: str) -> str:
    """SmolLM2's config and tokenizer with 2 layers of width 64 and random weights."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(SMOL)
    cfg.update(
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.exists(os.path.join(SMOL, f)):
            shutil.copy(os.path.join(SMOL, f), out)
    return out


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return 0.0


def _ttft(url: str, prompt: str) -> float:
    t0 = time.perf_counter()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0.0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def run_policy(policy: str, ckpt: str, args, prompts: list[str], logs: str) -> dict:
    reps = []
    try:
        for i in range(args.replicas):
            port = free_port()
            argv = tpuserve_argv(
                "serve",
                ckpt,
                "--served-model-name",
                "tiny",
                "--layer-loop",
                "scan",
                "--max-model-len",
                "1024",
                "--max-num-seqs",
                "8",
                "--no-warmup",
                "--port",
                str(port),
            )
            reps.append(
                ServerProcess(
                    argv,
                    port,
                    env={"JAX_PLATFORMS": "cpu"},
                    log_path=f"{logs}/{policy}-{i}.log",
                    startup_timeout=600,
                )
            )
        for r in reps:
            r.start()
        port = free_port()
        router = ServerProcess(
            tpuserve_argv(
                "router",
                *(x for r in reps for x in ("--replica", r.base_url)),
                "--policy",
                policy,
                "--port",
                str(port),
            ),
            port,
            log_path=f"{logs}/{policy}-router.log",
            startup_timeout=120,
        )
        router.start()
        reps.append(router)
        with ThreadPoolExecutor(args.concurrency) as pool:
            ttfts = list(pool.map(lambda p: _ttft(router.base_url, p), prompts))
        q = sum(_metric(r.base_url, "vllm:prefix_cache_queries_total") for r in reps[:-1])
        h = sum(_metric(r.base_url, "vllm:prefix_cache_hits_total") for r in reps[:-1])
        ttfts.sort()
        return {
            "policy": policy,
            "hit_rate": h / q if q else 0.0,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "requests": len(ttfts),
        }
    finally:
        for r in reversed(reps):
            r.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--system-words", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args(argv)
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    systems = [" ".join(rng.choice(words) for _ in range(args.system_words)) for _ in range(args.groups)]
    prompts = [
        f"{systems[g]}\nQuestion {i}: {rng.random()}"
        for i in range(args.per_group)
        for g in range(args.groups)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_checkpoint(os.path.join(tmp, "ckpt"))
        out = [run_policy(pol, ckpt, args, prompts, tmp) for pol in ("round-robin", "prefix")]
    for r in out:
        print(json.dumps(r))
    print(
        json.dumps(
            {
                "hit_rate_ratio": out[1]["hit_rate"] / max(out[0]["hit_rate"], 1e-9),
                "ttft_p50_ratio_prefix_over_rr": out[1]["ttft_p50_s"] / out[0]["ttft_p50_s"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

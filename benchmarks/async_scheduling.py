"""Async scheduling on vs off in the offline engine: time per output token at a fixed concurrency.

One engine, warmed up once; rounds alternate the two modes (``LLMEngine.async_scheduling`` is read
every step, and is only switched between rounds, with nothing in flight), so both see the same
compiled programs and the same drift of a shared machine. Each round runs ``--concurrency`` greedy
requests of ``--prompt-tokens`` random prompt tokens and ``--max-tokens`` output tokens (ignore_eos),
all admitted at once, and records when each request's first token and its last token reach the
host. Reported per mode: TPOT (last - first token time over the tokens between), median over
requests and rounds; output tokens/s; and the ratio sync / async (> 1: async is faster).

    python benchmarks/async_scheduling.py --concurrency 1 8 --rounds 3
    python benchmarks/async_scheduling.py --model /tmp/random-smollm2 --dtype bfloat16   # accelerator

This is the serving benchmark's ``--compare-sync`` without HTTP, for machines that cannot open
sockets (the lent TPU machine); what it measures is the same overlap of host work with device work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from engine_rounds import timed_round


def run_round(engine, concurrency: int, prompt_tokens: int, max_tokens: int, rng) -> dict:
    return timed_round(engine, concurrency, prompt_tokens, max_tokens, rng)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory (default: the default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode and concurrency")
    p.add_argument(
        "--num-gpu-blocks", type=int, default=None, help="KV pages (default: sized from memory as usual)"
    )
    p.add_argument(
        "--warmup",
        action="store_true",
        help="compile every shape bucket first (else the untimed first round compiles "
        "the shapes it uses, which is faster to start)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    from tpuserve.server.llm import LLM

    most = max(args.concurrency)
    kw = dict(
        dtype=args.dtype,
        max_num_seqs=most,
        async_scheduling=True,
        max_model_len=args.prompt_tokens + args.max_tokens + 16,
    )
    if args.num_gpu_blocks:
        kw["num_gpu_blocks"] = args.num_gpu_blocks
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    engine = llm.engine
    if args.warmup:
        engine.warmup()
    print(
        f"engine ready in {time.perf_counter() - t0:.1f} s ({engine.runner.attn_impl} attention, "
        f"{engine.runner.layer_loop} layers, device {engine.worker.device.device_kind})",
        flush=True,
    )
    rng = np.random.default_rng(0)
    results = []
    for c in args.concurrency:
        run_round(engine, c, args.prompt_tokens, args.max_tokens, rng)  # compiles what it uses
        per_mode: dict[str, list[dict]] = {"async": [], "sync": []}
        for r in range(args.rounds):
            order = ["async", "sync"] if r % 2 == 0 else ["sync", "async"]
            for mode in order:
                assert engine._inflight is None, "switching modes with a step in flight"
                engine.async_scheduling = mode == "async"
                res = run_round(engine, c, args.prompt_tokens, args.max_tokens, rng)
                per_mode[mode].append(res)
                print(
                    f"c={c} round {r + 1} {mode:5s}: TPOT p50 {statistics.median(res['tpot_ms']):7.2f} ms, "
                    f"{res['tokens'] / res['wall_s']:8.1f} tok/s",
                    flush=True,
                )
        row = {"concurrency": c}
        for mode, runs in per_mode.items():
            row[f"{mode}_tpot_ms"] = statistics.median([t for r in runs for t in r["tpot_ms"]])
            row[f"{mode}_tok_s"] = statistics.median([r["tokens"] / r["wall_s"] for r in runs])
            row[f"{mode}_round_tpot_ms"] = [statistics.median(r["tpot_ms"]) for r in runs]
        row["tpot_sync_over_async"] = row["sync_tpot_ms"] / row["async_tpot_ms"]
        results.append(row)
        print(
            f"c={c}: TPOT async {row['async_tpot_ms']:.2f} ms vs sync {row['sync_tpot_ms']:.2f} ms "
            f"-> sync/async {row['tpot_sync_over_async']:.3f}; tok/s async {row['async_tok_s']:.1f} "
            f"vs sync {row['sync_tok_s']:.1f}",
            flush=True,
        )
    engine.async_scheduling = True
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    command=" ".join([sys.executable] + sys.argv),
                    when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    device=engine.worker.device.device_kind,
                    results=results,
                ),
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

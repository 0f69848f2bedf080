"""Decode time per KV cache dtype on CPU: did an FP8 cache cost a copy of itself every step?

    python benchmarks/kv_cache_dtype_cpu.py --kv-cache-dtype fp8 --num-gpu-blocks 2048
    python benchmarks/kv_cache_dtype_cpu.py --kv-cache-dtype auto --num-gpu-blocks 2048

Runs the default model offline (no warm-up: the first generate compiles what the timed ones use),
then times ``--repeats`` greedy generates of ``--num-prompts`` prompts x ``--max-tokens`` tokens.
Reports wall time and this process's CPU time (all threads) per generate; on a shared machine the
CPU time moves less with the neighbours' load than the wall time. A copy of the whole cache per
layer per step shows as time that grows with ``--num-gpu-blocks``.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--num-gpu-blocks", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from tpuserve import LLM, SamplingParams

    llm = LLM(
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=512,
        max_num_seqs=args.num_prompts,
        num_gpu_blocks=args.num_gpu_blocks,
        warmup=False,
    )
    kv = llm.engine.runner.kv_cache
    print(f"cache {tuple(kv.shape)} stored as {kv.dtype}, {kv.nbytes / 2**20:.0f} MiB")
    prompts = [f"Write a short story about a robot number {i}." for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    for _ in range(args.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(
            f"{args.kv_cache_dtype}: {tokens} tokens, wall {wall:.2f} s ({wall / args.max_tokens * 1e3:.0f} ms"
            f" a step), CPU {cpu:.1f} s ({cpu / args.max_tokens * 1e3:.0f} ms a step)",
            flush=True,
        )


if __name__ == "__main__":
    main()

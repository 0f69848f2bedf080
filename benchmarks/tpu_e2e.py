"""End to end on one accelerator through the public ``LLM`` API: decode TPOT against the HBM roofline,
prefill throughput against peak FLOPs, time to ready and peak device memory.

Per model directory (random-weight checkpoints built on the machine with ``random_checkpoint.py``):

- ``LLM(model, dtype, gpu_memory_utilization)`` with every other flag at its default; time to ready.
- Decode at each batch size: ``batch`` greedy requests of ``--prompt-len`` random tokens and
  ``--new-tokens`` new tokens (ignore_eos), all admitted at once, after one untimed round of the
  same shape (it compiles what the round uses). TPOT is each request's (last - first token time) /
  (tokens - 1), the median over requests; tok/s is output tokens over the round's wall time.
- The roofline TPOT of that batch: (weight bytes read + KV bytes read) / HBM bandwidth, where the KV
  read is the logical cache rows of the mean context (prompt + half the new tokens) of every
  sequence, per layer, for K and V; the fraction reached is roofline / measured.
- The device's own share of a decode step: the runner's step for an empty batch of the same token
  bucket (it reads every weight, runs every matmul, attends to nothing), against the TPOT; the rest
  is the host and the gaps between steps (an estimate: attention over short contexts is small).
- Prefill: ``n x len`` prompts with one new token; tok/s and MFU = 2 x matmul parameters x tokens
  (+ causal attention FLOPs) / wall time / peak FLOP/s.
- ``--block-sizes JSON``: an A/B of the TPU attention kernel's per-generation defaults
  (``attention.pallas_tpu.BlockSizes`` fields, e.g. ``{"single_item_decode": true}``), replaced in
  this process before the engine compiles anything.

    python benchmarks/tpu_e2e.py --models /tmp/m/llama-1b-gqa --out e2e.json      # on the TPU
    python benchmarks/tpu_e2e.py --models $MODEL --dtype float32 --batches 1,4 \\
        --prefill 2x64 --peak-tflops 1 --hbm-gbs 50 --util 0.5                     # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import jax
import numpy as np
from engine_rounds import timed_round  # benchmarks/engine_rounds.py

V5E_HBM_GBS = 819.0
V5E_BF16_TFLOPS = 197.0


def model_bytes(runner) -> dict:
    """Bytes of the weights, of the weights every decode step reads (an untied input embedding is
    only gathered: B rows, not the table), and of the expert weights (read only as routed)."""
    leaves = jax.tree_util.tree_leaves_with_path(runner.params)
    total = sum(int(x.nbytes) for _, x in leaves)
    embed = sum(int(x.nbytes) for p, x in leaves if "embed" in jax.tree_util.keystr(p))
    experts = sum(int(x.nbytes) for p, x in leaves if "experts" in jax.tree_util.keystr(p))
    tied = bool(getattr(runner.arch, "tie_word_embeddings", True))
    dense = (total if tied else total - embed) - experts
    return dict(weights=total, decode_read=dense, experts=experts)


def decode_read_bytes(mb: dict, arch, tokens: int) -> float:
    """Weight bytes a decode step of ``tokens`` tokens reads: every dense weight, plus the experts the
    tokens are routed to, expected over uniform routing (E * (1 - (1 - k/E)^tokens) of E per layer)."""
    moe = getattr(arch, "moe", None)
    if moe is None or not mb["experts"]:
        return mb["decode_read"] + mb["experts"]
    touched = 1.0 - (1.0 - moe.top_k / moe.num_experts) ** tokens
    return mb["decode_read"] + mb["experts"] * touched


def matmul_params(arch) -> int:
    """Parameters that take part in a token's matmuls (layers and the LM head; not the gather): for a
    mixture-of-experts layer, its top-k experts'."""
    h, L = arch.hidden_size, arch.num_layers
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    attn = h * q + 2 * h * kv + q * h
    moe = getattr(arch, "moe", None)
    sparse = set(moe.moe_layers) if moe is not None else set()
    mlp = sum(
        3 * h * (moe.top_k * moe.expert_intermediate_size if i in sparse else arch.intermediate_size)
        for i in range(L)
    )
    return L * attn + mlp + h * arch.vocab_size


def kv_bytes_per_token(arch, itemsize: int) -> int:
    """Logical K and V bytes of one token over all layers (no lane padding)."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * itemsize


def decode_round(engine, batch: int, prompt_len: int, new_tokens: int, rng, temperature: float = 0.0) -> dict:
    r = timed_round(engine, batch, prompt_len, new_tokens, rng, temperature)
    return dict(r, tpot_ms=statistics.median(r["tpot_ms"]))


def device_trace(engine, batch: int, args, rng, out_dir: str) -> dict:
    """One more decode round under the JAX profiler: how busy the device was and with what."""
    from device_trace import report, summarize, traced  # benchmarks/device_trace.py

    with traced(out_dir):
        r = decode_round(engine, batch, args.prompt_len, args.new_tokens, rng, args.temperature)
    s = summarize(out_dir)
    s["round"] = {k: r[k] for k in ("engine_steps", "wall_s", "decode_step_ms")}
    print(f"  device trace b={batch} ({r['engine_steps']} steps, {r['wall_s'] * 1e3:.0f} ms):", flush=True)
    print("  " + report(s).replace("\n", "\n  "), flush=True)
    return s


def host_profile(engine, batch: int, args, rng, path: str) -> None:
    """cProfile of one decode round (what the host spends a step on), top functions by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    r = decode_round(engine, batch, args.prompt_len, args.new_tokens, rng, args.temperature)
    prof.disable()
    text = io.StringIO()
    text.write(
        f"batch {batch}: {r['engine_steps']} engine steps, TPOT {r['tpot_ms']:.2f} ms under the profiler\n"
    )
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    with open(path, "w") as f:
        f.write(text.getvalue())


def prefill_round(llm, n: int, length: int, rng) -> float:
    from tpuserve.server.sampling_params import SamplingParams

    vocab = llm.engine.arch.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(100, min(vocab, 30000), length).tolist()} for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    bad = [o.error for o in outs if getattr(o, "error", None)]
    if bad:
        raise RuntimeError(f"prefill {n}x{length}: {bad[0]}")
    return wall


def empty_step_ms(runner, tokens: int, iters: int = 20) -> float:
    """An empty step of this token bucket, ``iters`` dispatched back to back and waited for once:
    the device's time when the host dispatches faster than the device runs."""
    bucket = next((b for b in runner.token_buckets if b >= tokens), runner.token_buckets[-1])
    b = runner._empty_batch(bucket, runner.page_buckets[0])
    runner.forward(b)
    jax.block_until_ready(runner.kv_cache)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            runner.forward(b)
        jax.block_until_ready(runner.kv_cache)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e3


def override_block_sizes(fields: dict) -> None:
    """Replace ``fields`` of every generation's attention ``BlockSizes`` (benchmark A/B only)."""
    import dataclasses

    from tpuserve.attention import pallas_tpu

    table = pallas_tpu._BLOCK_SIZES_BY_GENERATION
    for key, sizes in table.items():
        table[key] = dataclasses.replace(sizes, **fields)
    pallas_tpu._FALLBACK_BLOCK_SIZES = dataclasses.replace(pallas_tpu._FALLBACK_BLOCK_SIZES, **fields)


def run_model(model: str, args) -> dict:
    from tpuserve import LLM

    kw = dict(dtype=args.dtype, gpu_memory_utilization=args.util, **json.loads(args.engine_args))
    if args.quantization:
        kw["quantization"] = args.quantization
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    ready = time.perf_counter() - t0
    engine = llm.engine
    runner = engine.runner
    compiled_at_ready = runner.compile_count
    arch = engine.arch
    itemsize = np.dtype(runner.kv_cache.dtype).itemsize
    mb = model_bytes(runner)
    res = dict(
        model=model,
        ready_s=ready,
        dtype=str(runner.kv_cache.dtype),
        quantization=args.quantization,
        engine_args=args.engine_args,
        temperature=args.temperature,
        num_pages=runner.kv_spec.num_pages,
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        max_num_batched_tokens=engine.config.scheduler.max_num_batched_tokens,
        attention=runner.attn_impl,
        layer_loop=runner.layer_loop,
        async_scheduling=engine.async_scheduling,
        weight_bytes=mb["weights"],
        plan=None if engine.worker._plan is None else engine.worker._plan.describe(),
        decode=[],
        prefill=[],
    )
    print(f"{model}: ready in {ready:.1f} s; {res['plan']}", flush=True)
    rng = np.random.default_rng(0)
    hbm = args.hbm_gbs * 1e9
    for batch in args.batches:
        if batch > res["max_num_seqs"]:
            continue
        t = args.temperature
        decode_round(engine, batch, args.prompt_len, args.new_tokens, rng, t)  # compiles its shapes
        runs = [
            decode_round(engine, batch, args.prompt_len, args.new_tokens, rng, t) for _ in range(args.rounds)
        ]
        if args.host_profile and batch in (1, max(args.batches)):
            host_profile(engine, batch, args, rng, f"{args.host_profile}_b{batch}.txt")
        trace = None
        if args.device_trace and batch in (1, max(args.batches)):
            trace = device_trace(engine, batch, args, rng, f"{args.device_trace}_b{batch}")
        tpot = statistics.median(r["tpot_ms"] for r in runs)
        tok_s = statistics.median(r["tokens"] / r["wall_s"] for r in runs)
        ctx = args.prompt_len + args.new_tokens / 2
        read = decode_read_bytes(mb, arch, batch) + batch * ctx * kv_bytes_per_token(arch, itemsize)
        roof_ms = read / hbm * 1e3
        dev_ms = empty_step_ms(runner, batch)
        step_ms = statistics.median(r["decode_step_ms"] or float("nan") for r in runs)
        row = dict(
            batch=batch,
            tpot_ms=tpot,
            decode_step_ms=step_ms,
            device_trace=trace,
            tok_s=tok_s,
            roofline_ms=roof_ms,
            roofline_fraction=roof_ms / tpot,
            empty_step_ms=dev_ms,
            host_share_est=max(0.0, 1 - dev_ms / tpot),
            rounds=runs,
        )
        res["decode"].append(row)
        print(
            f"  decode b={batch:3d}: TPOT {tpot:7.2f} ms, {tok_s:8.1f} tok/s, roofline {roof_ms:.2f} ms "
            f"-> {roof_ms / tpot:5.1%}; decode-only step {step_ms:.2f} ms ({roof_ms / step_ms:5.1%}); "
            f"empty step {dev_ms:.2f} ms (host share ~{row['host_share_est']:.0%})",
            flush=True,
        )
    flops_per_token = 2 * matmul_params(arch)
    for spec in args.prefill:
        n, length = (int(x) for x in spec.split("x"))
        length = min(length, engine.max_model_len - 1)  # room for the one new token
        if n > res["max_num_seqs"]:
            continue
        prefill_round(llm, n, length, rng)  # compiles its shapes
        walls = [prefill_round(llm, n, length, rng) for _ in range(args.rounds)]
        wall = statistics.median(walls)
        tokens = n * length
        attn = n * 2 * 2 * arch.num_layers * arch.num_heads * arch.head_dim * length * length / 2
        mfu = (flops_per_token * tokens + attn) / wall / (args.peak_tflops * 1e12)
        row = dict(n=n, length=length, wall_s=wall, tok_s=tokens / wall, mfu=mfu, walls=walls)
        res["prefill"].append(row)
        print(
            f"  prefill {n}x{length}: {wall * 1e3:.0f} ms, {tokens / wall:9.0f} tok/s, MFU {mfu:.1%}",
            flush=True,
        )
    stats = jax.devices()[0].memory_stats() or {}
    res["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    res["bytes_limit"] = stats.get("bytes_limit")
    res["compiled"] = runner.compile_count
    res["compiled_at_ready"] = compiled_at_ready
    if stats:
        print(
            f"  peak device memory {stats.get('peak_bytes_in_use', 0) / 2**30:.2f} GiB of "
            f"{stats.get('bytes_limit', 0) / 2**30:.2f} GiB; {runner.compile_count} programs "
            f"({compiled_at_ready} when ready)",
            flush=True,
        )
    del llm, engine, runner
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True, help="comma-separated model directories")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--util", type=float, default=0.9, help="gpu_memory_utilization")
    p.add_argument("--quantization", default=None)
    p.add_argument("--engine-args", default="{}", help="more LLM keyword arguments, as JSON")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="decode sampling (0: greedy)")
    p.add_argument(
        "--host-profile", default=None, help="PREFIX: cProfile a decode round at batch 1 and the largest"
    )
    p.add_argument(
        "--device-trace",
        default=None,
        help="path prefix: a profiler trace of one more round at batch 1 and the largest batch, summarized",
    )
    p.add_argument("--prefill", default="8x1024,1x8192", help="n x length, comma-separated ('' for none)")
    p.add_argument("--hbm-gbs", type=float, default=V5E_HBM_GBS)
    p.add_argument("--peak-tflops", type=float, default=V5E_BF16_TFLOPS)
    p.add_argument("--block-sizes", default="{}", help="attention BlockSizes fields to replace, as JSON")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    block_sizes = json.loads(args.block_sizes)
    if block_sizes:
        override_block_sizes(block_sizes)
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.prefill = [x for x in args.prefill.split(",") if x]
    out = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        command=" ".join([sys.executable] + sys.argv),
        when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        block_sizes=block_sizes,
        models=[],
    )
    for model in args.models.split(","):
        try:
            out["models"].append(run_model(model, args))
        except Exception as e:
            print(f"{model}: FAILED {e!r}"[:2000], flush=True)
            traceback.print_exc()  # where it failed (start-up phase, which program) is the next step
            out["models"].append(
                dict(model=model, error=repr(e)[:4000], traceback=traceback.format_exc()[-8000:])
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

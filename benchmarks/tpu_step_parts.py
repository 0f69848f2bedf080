"""Where a decode step's device time goes, on the chip: each matmul shape of a model alone at the
row counts decode uses (GB/s against the HBM roofline), and the runner's empty step per token bucket
with each attention implementation, with the optimized HLO of chosen buckets and a profiler trace
written for reading offline.

    python benchmarks/tpu_step_parts.py --model llama-1b --out $OUT/parts      # on the TPU
    python benchmarks/tpu_step_parts.py --model tiny --rows 1,8 --buckets 1,8 \\
        --impls reference --out /tmp/parts                                      # CPU smoke

Shapes come from tpu_memory.py's table (weights are constants: values do not matter for time).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time

import jax
import jax.numpy as jnp
from tpu_memory import SHAPES, hf_config, random_params

HBM_GBS = 819.0


def best_ms(fn, *args, iters: int = 10) -> float:
    """Best of three runs of ``iters`` calls dispatched back to back and waited for once."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e3


def matmul_case(rows: int, k: int, n: int, layers: int, transposed: bool, dtype) -> dict:
    """``layers`` matmuls x [rows, k] @ w[l] ([k, n], or [n, k] used transposed as a tied LM head
    uses the embedding) in one scan, as the decoder's layer loop runs them."""
    shape = (layers, n, k) if transposed else (layers, k, n)
    w = jnp.full(shape, 0.01, dtype)
    x = jnp.full((rows, k), 0.01, dtype)

    @jax.jit
    def run(x, w):
        def body(acc, wl):
            y = x @ (wl.T if transposed else wl)
            return acc + jnp.sum(y.astype(jnp.float32)), None

        return jax.lax.scan(body, jnp.float32(0), w)[0]

    ms = best_ms(run, x, w) / layers
    gbs = k * n * jnp.dtype(dtype).itemsize / (ms * 1e-3) / 1e9
    return dict(rows=rows, k=k, n=n, transposed=transposed, ms=ms, gbs=gbs, roofline=gbs / HBM_GBS)


def model_matmuls(arch) -> list[tuple[str, int, int, int, bool]]:
    h, f, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    layers = arch.num_layers
    return [
        ("qkv", h, qkv, layers, False),
        ("o", arch.num_heads * d, h, layers, False),
        ("gate_up", h, 2 * f, layers, False),
        ("down", f, h, layers, False),
        ("lm_head_tied", h, arch.vocab_size, 1, True),
        ("lm_head_untied", h, arch.vocab_size, 1, False),
    ]


MLP_LAYOUTS = ("h2f", "hflat", "2hf", "nh", "split")


def mlp_case(layout: str, rows: int, h: int, f: int, layers: int, dtype) -> dict:
    """The decoder's MLP (rms-normed input, gate_up dot, silu * up, down dot, residual) scanned over
    ``layers`` with gate_up stored as: h2f [H, 2, F] (today's tree), hflat [H, 2F], 2hf [2, H, F],
    nh [2F, H] (contracted on its minor axis) or split (gate and up [H, F] each). The residual is
    carried from layer to layer as in the model, so XLA sees the same data flow."""
    shapes = {"h2f": (h, 2, f), "hflat": (h, 2 * f), "2hf": (2, h, f), "nh": (2 * f, h), "split": (h, f)}
    gate_up = jnp.full((layers,) + shapes[layout], 0.01, dtype)
    up_only = jnp.full((layers, h, f), 0.01, dtype) if layout == "split" else None
    down = jnp.full((layers, f, h), 0.01, dtype)
    x0 = jnp.full((rows, h), 0.01, dtype)

    def gate_and_up(x, w, u):
        if layout == "h2f":
            gu = jnp.einsum("th,hgf->tgf", x, w)
            return gu[:, 0], gu[:, 1]
        if layout == "hflat":
            gu = (x @ w).reshape(rows, 2, f)
            return gu[:, 0], gu[:, 1]
        if layout == "2hf":
            gu = jnp.einsum("th,ghf->tgf", x, w)
            return gu[:, 0], gu[:, 1]
        if layout == "nh":
            gu = jnp.einsum("th,nh->tn", x, w).reshape(rows, 2, f)
            return gu[:, 0], gu[:, 1]
        return x @ w, x @ u

    @jax.jit
    def run(x, gate_up, up_only, down):
        def body(hid, ws):
            w, u, d = ws
            xn = hid * jax.lax.rsqrt(jnp.mean(jnp.square(hid.astype(jnp.float32)), -1, keepdims=True) + 1e-5)
            g, up = gate_and_up(xn.astype(dtype), w, u)
            return hid + (jax.nn.silu(g) * up) @ d, None

        u = up_only if up_only is not None else jnp.zeros((layers,), dtype)
        return jax.lax.scan(body, x, (gate_up, u, down))[0]

    ms = best_ms(run, x0, gate_up, up_only, down) / layers
    compiled = run.lower(x0, gate_up, up_only, down).compile()
    copies = [
        ln.strip()[:160]
        for ln in compiled.as_text().splitlines()
        if " copy(" in ln and (f",{f}]" in ln or f",{2 * f}]" in ln or f"[{2 * f}," in ln)
    ]
    gbs = 3 * h * f * jnp.dtype(dtype).itemsize / (ms * 1e-3) / 1e9
    return dict(layout=layout, rows=rows, ms=ms, gbs=gbs, roofline=gbs / HBM_GBS, weight_copies=copies)


def runner_steps(name: str, impl: str, buckets, pages: int, hlo_buckets, out_dir: str, trace: bool) -> dict:
    from tpuserve.tpu_platform.config import EngineConfig
    from tpuserve.tpu_platform.device import discover, resolve_dtype
    from tpuserve.tpu_platform.model_runner import ModelRunner
    from tpuserve.tpu_platform.models.arch import ModelArch

    device = discover()
    dtype = resolve_dtype("auto", device)
    arch = ModelArch.from_hf_config(hf_config(name))
    cfg = EngineConfig.from_kwargs(
        attention_impl=impl, max_num_seqs=256, max_model_len=2048, max_num_batched_tokens=max(buckets)
    )
    runner = ModelRunner(cfg, arch, random_params(arch, dtype), device, dtype, None, 2048)
    runner.allocate_kv_cache(pages)
    res = dict(impl=runner.attn_impl, layer_loop=runner.layer_loop, steps={})
    for t in buckets:
        b = runner._empty_batch(t, runner.page_buckets[0])

        def step(b=b):
            runner.forward(b)
            return runner.kv_cache

        res["steps"][t] = best_ms(step)
        if t in hlo_buckets:
            fn = os.path.join(out_dir, f"{name}_{runner.attn_impl}_t{t}.hlo.gz")
            with gzip.open(fn, "wt") as f:
                f.write(runner.step_hlo(b))
            if trace:
                from device_trace import report, summarize, traced  # benchmarks/device_trace.py

                trace_dir = os.path.join(out_dir, f"trace_{runner.attn_impl}_t{t}")
                with traced(trace_dir):
                    for _ in range(5):
                        step()
                    jax.block_until_ready(runner.kv_cache)
                # ops by device time, to read against the HLO above (fusion names match)
                summary = summarize(trace_dir, top=30)
                res.setdefault("traces", {})[t] = summary
                print(f"trace t{t} ({runner.attn_impl}):\n{report(summary)}", flush=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--buckets", default="1,2,4,8,16,32,128")
    p.add_argument("--impls", default="auto,reference")
    p.add_argument("--pages", type=int, default=2048)
    p.add_argument("--hlo-buckets", default="1,8")
    p.add_argument("--trace", action="store_true")
    p.add_argument(
        "--mlp", default="", help="MLP gate_up layouts to compare (all: " + ",".join(MLP_LAYOUTS) + ")"
    )
    p.add_argument("--mlp-only", action="store_true", help="only the MLP layouts")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from tpuserve.tpu_platform.device import discover, resolve_dtype
    from tpuserve.tpu_platform.models.arch import ModelArch

    dtype = resolve_dtype("auto", discover())
    arch = ModelArch.from_hf_config(hf_config(args.model))
    result = dict(model=args.model, device=jax.devices()[0].device_kind, matmuls=[], runner={}, mlp=[])
    for layout in [m for m in args.mlp.split(",") if m]:
        for rows in [int(r) for r in args.rows.split(",")]:
            r = mlp_case(layout, rows, arch.hidden_size, arch.intermediate_size, arch.num_layers, dtype)
            result["mlp"].append(r)
            print(
                f"mlp {layout:6s} rows {rows:4d}: {r['ms'] * 1e3:7.1f} us/layer, {r['gbs']:6.1f} GB/s "
                f"({r['roofline']:.0%}); weight copies: {len(r['weight_copies'])}",
                flush=True,
            )
            for c in r["weight_copies"]:
                print("   ", c, flush=True)
    if args.mlp_only:
        with open(os.path.join(args.out, "parts.json"), "w") as f:
            json.dump(result, f, indent=1)
        return 0
    for rows in [int(r) for r in args.rows.split(",")]:
        for label, k, n, layers, transposed in model_matmuls(arch):
            row = dict(name=label, **matmul_case(rows, k, n, layers, transposed, dtype))
            result["matmuls"].append(row)
            print(
                f"matmul {label:15s} rows {rows:4d} [{k}x{n}]: {row['ms'] * 1e3:7.1f} us, "
                f"{row['gbs']:6.1f} GB/s ({row['roofline']:.0%})",
                flush=True,
            )
    buckets = [int(b) for b in args.buckets.split(",")]
    hlo_buckets = {int(b) for b in args.hlo_buckets.split(",") if b}
    for impl in args.impls.split(","):
        r = runner_steps(args.model, impl, buckets, args.pages, hlo_buckets, args.out, args.trace)
        result["runner"][impl] = r
        steps = ", ".join(f"t{t} {ms:.2f}" for t, ms in r["steps"].items())
        print(f"empty step ms ({r['impl']}, {r['layer_loop']}): {steps}", flush=True)
    with open(os.path.join(args.out, "parts.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

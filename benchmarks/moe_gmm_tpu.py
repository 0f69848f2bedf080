"""TPU grouped matmul (MoE experts): our Pallas kernel vs jax's megablox gmm vs ``jax.lax.ragged_dot``.

On a TPU machine (JAX_PLATFORMS unset):

    python benchmarks/moe_gmm_tpu.py --out /tmp/moe_gmm_tpu.json
    python benchmarks/moe_gmm_tpu.py --smoke     # tiny sizes, kernels interpreted: any machine

For MoE-shaped problems - Qwen3-30B-A3B-like (H 2048, expert F 768, 128 experts, top-8) and
gpt-oss-20b-like (H 2880, F 2880, 32 experts, top-4) at 8 / 64 / 512 / 2048 tokens - each token
is routed to top-k distinct experts drawn uniformly (seeded), rows are sorted by expert, and both
expert matmuls are timed in bf16: gate_up ``[T*k, H] @ [G, H, 2F]`` and down ``[T*k, F] @ [G, F, H]``.

Per case and implementation: median ms over ``--repeats`` batches of ``--iters`` back-to-back
calls (dispatch overlaps the device work, so small kernels are not timed as launch overhead),
achieved GB/s (the bytes that must move: lhs, the weights of every expert that got a row, the
output) and TFLOP/s (2 * M * K * N), each as a fraction of the v5e's HBM roofline (819 GB/s) and
bf16 peak (197 TFLOP/s), and ``roofline_fraction`` = max(bytes / 819 GB/s, flops / 197 TFLOP/s) /
time, the share of the better bound reached. Results are checked against ragged_dot with f32
accumulation (relative max error <= 2e-2 of the largest magnitude). A failing case or
implementation is recorded and the rest still run; the exit status is 1 if any failed.

``--int8`` adds ``ours_int8``: our kernel on the same experts quantized to int8 per output channel
(bytes counted at one per weight), checked against ragged_dot on the dequantized weight.
``--mxfp4`` adds ``ours_mxfp4``: our kernel on the experts quantized to MXFP4 by ``quant.fp4``
(packed bytes decoded in VMEM; ``K * N * (1/2 + 1/32)`` bytes per active expert), checked likewise;
``--fp4-decode f32,swar`` times it with each of the kernel's MXFP4 decodes (``ours_mxfp4`` is
"f32", the others ``ours_mxfp4_<decode>``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from device_timing import median_seconds
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

from tpuserve.moe.pallas_tpu_gmm import default_tiling, grouped_matmul_tpu
from tpuserve.quant.fp4 import MXFP4_BLOCK, dequantize_mxfp4, quantize_mxfp4

HBM_BYTES_PER_S = 819e9  # v5e
PEAK_FLOPS = 197e12  # v5e, bf16

# name: (hidden H, expert intermediate F, experts G, top-k)
MODELS = {
    "qwen3_30b_a3b": (2048, 768, 128, 8),
    "gpt_oss_20b": (2880, 2880, 32, 4),
}
SMOKE_MODELS = {"smoke": (256, 128, 8, 2)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write results JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, kernels in TPU interpret mode")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {list(MODELS)}")
    p.add_argument("--tokens", default="8,64,512,2048")
    p.add_argument("--projections", default="gate_up,down")
    p.add_argument("--iters", type=int, default=10, help="back-to-back calls per timed batch")
    p.add_argument("--repeats", type=int, default=5, help="timed batches (median reported)")
    p.add_argument(
        "--tilings",
        default="",
        help="extra tilings of our kernel to time, 'tm,tk,tn;tm,tk,tn' (the default tiling always runs)",
    )
    p.add_argument("--int8", action="store_true", help="also time our kernel on int8 per-channel experts")
    p.add_argument("--mxfp4", action="store_true", help="also time our kernel on MXFP4 experts")
    p.add_argument(
        "--fp4-decode", default="f32", help="with --mxfp4: the kernel's decodes to time (comma list)"
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def route(tokens: int, experts: int, top_k: int, rng) -> np.ndarray:
    """Rows per expert when each token picks ``top_k`` distinct experts uniformly at random."""
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(picks.ravel(), minlength=experts).astype(np.int32)


def implementations(m: int, k: int, n: int, interpret, extra_tilings):
    """name -> (function of (lhs, rhs, group_sizes), tiling or None)."""
    tm = min(m, 128)
    impls = {
        "ours": (lambda a, b, c: grouped_matmul_tpu(a, b, c, interpret=interpret), default_tiling(m, k, n)),
    }
    for t in extra_tilings:
        impls[f"ours_{t[0]}x{t[1]}x{t[2]}"] = (
            lambda a, b, c, t=t: grouped_matmul_tpu(a, b, c, tiling=t, interpret=interpret),
            t,
        )
    # megablox needs M to be a multiple of its row tile; the sizes here are T * k, so tm divides
    for mt in ((tm, 128, 128), (tm, min(k, 512), min(n, 512))):
        impls[f"megablox_{mt[0]}x{mt[1]}x{mt[2]}"] = (
            lambda a, b, c, mt=mt: megablox_gmm(
                a, b, c, preferred_element_type=a.dtype, tiling=mt, interpret=interpret or False
            ),
            mt,
        )
    impls["ragged_dot"] = (lambda a, b, c: jax.lax.ragged_dot(a, b, c), None)
    return impls


def measure(fn, operands, want, bytes_moved: int, flops: int, args) -> dict:
    """Check ``fn(*operands)`` against ``want`` (f32), then time it; errors are recorded, not raised."""
    res = {}
    bound = max(bytes_moved / HBM_BYTES_PER_S, flops / PEAK_FLOPS)
    try:
        jitted = jax.jit(fn)
        t0 = time.perf_counter()
        got = np.asarray(jax.block_until_ready(jitted(*operands)), np.float32)
        res["first_call_s"] = round(time.perf_counter() - t0, 3)
        err = float(np.max(np.abs(got - want))) / (float(np.max(np.abs(want))) or 1.0)
        res["max_rel_err"] = err
        res["agrees"] = bool(err <= 2e-2)
        sec = median_seconds(jitted, operands, args.iters, args.repeats)
        res.update(
            bytes=bytes_moved,
            median_ms=sec * 1e3,
            gb_per_s=bytes_moved / sec / 1e9,
            tflop_per_s=flops / sec / 1e12,
            hbm_fraction=bytes_moved / sec / HBM_BYTES_PER_S,
            peak_fraction=flops / sec / PEAK_FLOPS,
            roofline_fraction=bound / sec,
        )
    except Exception as e:  # one implementation failing must not stop the others
        res["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        res["traceback"] = traceback.format_exc()[-4000:]
    return res


def ragged_dot_f32(lhs, rhs, gs, scale=None):
    """The check's oracle: ragged_dot with f32 accumulation (of ``rhs * scale`` when quantized)."""
    if scale is not None:
        lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32) * scale
    return jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)


def run_case(
    model, projection, tokens, dims, args, rng, weights, qweights, fp4weights, interpret, extra_tilings
):
    h, f, g, top_k = dims
    k, n = (h, 2 * f) if projection == "gate_up" else (f, h)
    m = tokens * top_k
    sizes = route(tokens, g, top_k, rng)
    lhs = jax.random.normal(jax.random.key(tokens), (m, k), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes)
    active = int(np.count_nonzero(sizes))
    bytes_moved = 2 * (m * k + active * k * n + m * n)
    flops = 2 * m * k * n
    bound = max(bytes_moved / HBM_BYTES_PER_S, flops / PEAK_FLOPS)
    case = dict(
        model=model, projection=projection, tokens=tokens, m=m, k=k, n=n, experts=g, top_k=top_k,
        active_experts=active, bytes=bytes_moved, flops=flops, roofline_ms=bound * 1e3, results={},
    )  # fmt: skip
    want = np.asarray(jax.jit(ragged_dot_f32)(lhs, weights, gs))
    for name, (fn, tiling) in implementations(m, k, n, interpret, extra_tilings).items():
        res = dict(tiling=list(tiling) if tiling else None)
        res.update(measure(fn, (lhs, weights, gs), want, bytes_moved, flops, args))
        case["results"][name] = res
        print(format_result(case, name, res), flush=True)
    if qweights is not None:  # int8 experts: one byte per weight, 4 per scale; checked on the dequant
        q, scale = qweights
        q_bytes = 2 * (m * k + m * n) + active * (k * n + 4 * n)
        q_want = np.asarray(jax.jit(ragged_dot_f32)(lhs, q, gs, scale))
        res = dict(tiling=list(default_tiling(m, k, n)), int8=True)
        fn = lambda a, b, c, s: grouped_matmul_tpu(a, b, c, s, interpret=interpret)  # noqa: E731
        res.update(measure(fn, (lhs, q, gs, scale), q_want, q_bytes, flops, args))
        case["results"]["ours_int8"] = res
        print(format_result(case, "ours_int8", res), flush=True)
    if fp4weights is not None:  # MXFP4 experts: half a byte per weight plus a scale byte per 32
        rec, deq = fp4weights
        q_bytes = 2 * (m * k + m * n) + active * (k * n // 2 + k // MXFP4_BLOCK * n)
        q_want = np.asarray(jax.jit(ragged_dot_f32)(lhs.astype(jnp.float32), deq, gs))
        for decode in [d for d in args.fp4_decode.split(",") if d]:
            res = dict(tiling=list(default_tiling(m, k, n, 1024)), mxfp4=True, fp4_decode=decode)
            fn = lambda a, b, c, d=decode: grouped_matmul_tpu(a, b, c, fp4_decode=d, interpret=interpret)  # noqa: E731
            res.update(measure(fn, (lhs, rec, gs), q_want, q_bytes, flops, args))
            name = "ours_mxfp4" if decode == "f32" else f"ours_mxfp4_{decode}"
            case["results"][name] = res
            print(format_result(case, name, res), flush=True)
    return case


def quantize_int8(weights):
    """Per-expert, per-output-channel int8: codes ``[G, K, N]`` and f32 scales ``[G, 1, N]``."""
    w = weights.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=1, keepdims=True), 1e-12) / 127.0
    return jnp.round(w / scale).astype(jnp.int8), scale


def format_result(case, name, res):
    head = f"{case['model']:>14} {case['projection']:>7} T={case['tokens']:<5} M={case['m']:<6} {name:<24}"
    if "error" in res:
        return f"{head} ERROR {res['error'][:200]}"
    if "median_ms" not in res:
        return f"{head} (no timing)"
    flag = "" if res["agrees"] else f"  MISMATCH rel err {res['max_rel_err']:.3g}"
    return (
        f"{head} {res['median_ms']:8.3f} ms {res['gb_per_s']:7.1f} GB/s ({res['hbm_fraction']:5.1%})"
        f" {res['tflop_per_s']:6.1f} TF/s ({res['peak_fraction']:5.1%}) roofline {res['roofline_fraction']:5.1%}{flag}"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = jax.default_backend()
    if backend != "tpu" and not args.smoke:
        print(
            f"moe_gmm_tpu.py times compiled TPU kernels and needs a TPU (jax's backend here is {backend!r}); "
            "run it on a TPU machine, or pass --smoke to run tiny sizes in TPU interpret mode.",
            file=sys.stderr,
        )
        return 2
    interpret = pltpu.InterpretParams() if args.smoke and backend != "tpu" else None
    models = SMOKE_MODELS if args.smoke else {name: MODELS[name] for name in args.models.split(",")}
    token_counts = [4, 24] if args.smoke else [int(t) for t in args.tokens.split(",")]
    iters, repeats = (1, 1) if args.smoke else (args.iters, args.repeats)
    args.iters, args.repeats = iters, repeats
    extra = [tuple(int(v) for v in t.split(",")) for t in args.tilings.split(";") if t]
    rng = np.random.default_rng(args.seed)
    cases, failures = [], 0
    start = time.perf_counter()
    for model, dims in models.items():
        h, f, g, _ = dims
        for projection in args.projections.split(","):
            k, n = (h, 2 * f) if projection == "gate_up" else (f, h)
            try:
                weights = (jax.random.normal(jax.random.key(g), (g, k, n), jnp.float32) / np.sqrt(k)).astype(
                    jnp.bfloat16
                )
            except Exception as e:
                print(f"{model} {projection}: could not build the weights: {e}", flush=True)
                failures += 1
                continue
            qweights = None
            if args.int8:
                try:
                    qweights = jax.jit(quantize_int8)(weights)
                except Exception as e:
                    print(f"{model} {projection}: could not quantize the weights: {e}", flush=True)
                    failures += 1
            fp4weights = None
            if args.mxfp4:
                try:
                    rec = jax.jit(lambda w: quantize_mxfp4(w, num_lead=1))(weights)
                    fp4weights = rec, jax.jit(dequantize_mxfp4)(rec)  # [G, K, N] f32, the oracle's
                except Exception as e:
                    print(f"{model} {projection}: could not quantize the weights to MXFP4: {e}", flush=True)
                    failures += 1
            for tokens in token_counts:
                try:
                    case = run_case(
                        model,
                        projection,
                        tokens,
                        dims,
                        args,
                        rng,
                        weights,
                        qweights,
                        fp4weights,
                        interpret,
                        extra,
                    )
                except Exception as e:
                    case = dict(model=model, projection=projection, tokens=tokens, error=repr(e)[:2000])
                    print(f"{model} {projection} T={tokens}: case failed: {e!r}"[:400], flush=True)
                cases.append(case)
                results = case.get("results", {})
                failures += "error" in case or any(
                    "error" in r or not r.get("agrees", True) for r in results.values()
                )
            del weights, qweights, fp4weights
    summary = dict(
        command=" ".join(sys.argv),
        jax=jax.__version__,
        python=platform.python_version(),
        backend=backend,
        device=str(jax.devices()[0].device_kind),
        hbm_bytes_per_s=HBM_BYTES_PER_S,
        peak_flops=PEAK_FLOPS,
        iters=iters,
        repeats=repeats,
        seconds=round(time.perf_counter() - start, 1),
        failures=int(failures),
        cases=cases,
    )
    print(f"{len(cases)} cases in {summary['seconds']} s, {failures} with a failure", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(summary, fh, indent=1)
        print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

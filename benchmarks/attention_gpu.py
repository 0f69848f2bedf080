"""GPU ragged paged attention: correctness check, then decode timings against peers and a roofline.

On the GPU machine (one H200, jax 0.11.2 CUDA):

    python benchmarks/attention_gpu.py --out /tmp/attention_gpu.json

1. Checks the GPU path (attention/pallas_gpu.py) against the jnp reference on a mixed batch
   (decode + prefill chunks + sliding window + soft cap; f32 and bf16) and a decode batch.
2. Measures HBM copy bandwidth (a large device copy: bytes read + written / time).
3. Decode at batch 1, 32, 128 x context 1k..32k: times our kernel (attention only, and with the
   in-kernel-call KV write on a donated cache) and jax's shipped
   ``jax.experimental.pallas.ops.gpu.paged_attention``; reports KV bytes read / time as a
   fraction of the copy bandwidth, the speedup over jax's kernel, and the largest difference
   between the two outputs.
4. Prints a table and writes everything (with the command line and versions) as JSON to --out.

``--smoke`` runs tiny sizes (on CPU: kernels in interpret mode) to prove the script runs.
The full run compiles 3 kernels per (batch, context) and needs ~35 GB of GPU memory at batch 128 x
32k (our cache plus the peer's K/V copy); expect a few minutes. ``--batches`` / ``--contexts`` trim
it. Exit status 1 if the correctness checks fail.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from device_timing import copy_bandwidth, time_calls
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

from tpuserve.attention.pallas_gpu import ragged_paged_attention_gpu_stacked
from tpuserve.attention.reference import ragged_paged_attention_ref, write_kv_ref


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write results JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; interpret mode off-GPU")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20, help="timed calls per repeat")
    p.add_argument("--copy-gib", type=float, default=4.0, help="size of the bandwidth probe")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.contexts = "1,2", "64,128"
        args.num_q_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.dtype, args.iters, args.copy_gib = "float32", 2, 0.01
    return args


def random_pages(rng, num_seqs: int, pages_per_seq: int):
    """[num_seqs, pages_per_seq] distinct pages from 1.. (page 0 stays reserved)."""
    perm = rng.permutation(np.arange(1, 1 + num_seqs * pages_per_seq)).astype(np.int32)
    return perm.reshape(num_seqs, pages_per_seq)


def check_against_reference(args, interpret: bool) -> list[dict]:
    """Mixed and decode batches: GPU path vs write_kv_ref + ragged_paged_attention_ref."""
    rng = np.random.default_rng(0)
    ps, hq, hkv, d = args.page_size, args.num_q_heads, args.num_kv_heads, args.head_dim
    small = args.smoke
    batches = {
        # (q_len, kv_len) per sequence: decodes, a whole prompt, chunks crossing pages.
        "mixed": [(1, 9), (1, 300), (37, 37), (20, 131), (1, 1), (5, 16)]
        if not small
        else [(1, 9), (7, 7), (5, 21), (1, 1)],
        "decode": [(1, 2048 - 17 * i) for i in range(8)] if not small else [(1, 60), (1, 17), (1, 3)],
    }
    options = [dict(sm_scale=d**-0.5), dict(sm_scale=d**-0.5, sliding_window=64, soft_cap=30.0)]
    results = []
    for name, seqs in batches.items():
        for dtype in (jnp.float32, jnp.bfloat16):
            for kw in options:
                slots = len(seqs) + 1
                pps = max(pl_cdiv(kv, ps) for _, kv in seqs)
                pages = np.zeros((slots, pps), np.int32)
                pages[: len(seqs)] = random_pages(rng, len(seqs), pps)
                q_lens = [q for q, _ in seqs]
                cu = np.full(slots + 1, sum(q_lens), np.int32)
                cu[0], cu[1 : len(seqs) + 1] = 0, np.cumsum(q_lens)
                kv_lens = np.zeros(slots, np.int32)
                kv_lens[: len(seqs)] = [kv for _, kv in seqs]
                t = sum(q_lens) + 3  # padding tokens too
                md = (
                    jnp.asarray(kv_lens),
                    jnp.asarray(pages),
                    jnp.asarray(cu),
                    jnp.asarray([len(seqs)], jnp.int32),
                )
                q = jnp.asarray(rng.standard_normal((t, hq, d)), dtype)
                new_kv = jnp.asarray(rng.standard_normal((t, 2 * hkv, d)), dtype)
                cache = jnp.asarray(rng.standard_normal((1 + slots * pps, ps, 2 * hkv, d)), dtype)
                want_kv = write_kv_ref(cache, new_kv, *md)
                want = ragged_paged_attention_ref(q, want_kv, *md, **kw)
                out, got_kv = ragged_paged_attention_gpu_stacked(
                    q, new_kv, cache[None], jnp.int32(0), *md, interpret=interpret, **kw
                )
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
                kv_ok = bool(jnp.array_equal(got_kv[0], want_kv))
                tol = 2e-3 if dtype == jnp.float32 else 3e-2
                results.append(
                    dict(
                        batch=name,
                        dtype=jnp.dtype(dtype).name,
                        options=str(kw),
                        max_abs_err=err,
                        kv_write_exact=kv_ok,
                        passed=bool(err <= tol and kv_ok),
                    )
                )
                verdict = "PASS" if results[-1]["passed"] else "FAIL"
                print(
                    f"check {name:6s} {jnp.dtype(dtype).name:8s} {str(kw):60s} "
                    f"max|err|={err:.2e} kv_exact={kv_ok} {verdict}"
                )
    return results


def pl_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bench_batch(args, batch: int, contexts: list[int], copy_bw: float, interpret: bool):
    """Decode rows for one batch size: one cache sized for the longest context, reused."""
    ps, hq, hkv, d = args.page_size, args.num_q_heads, args.num_kv_heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    max_pps = pl_cdiv(max(contexts), ps)
    num_pages = 1 + batch * max_pps
    key = jax.random.PRNGKey(batch)
    k1, k2, k3 = jax.random.split(key, 3)
    cache = jax.random.normal(k1, (1, num_pages, ps, 2 * hkv, d), dtype)
    q = jax.random.normal(k2, (batch, hq, d), dtype)
    new_kv = jax.random.normal(k3, (batch, 2 * hkv, d), dtype)
    # jax's kernel wants K and V apart, heads first: [Hkv, P, ps, D].
    k_pages = jnp.transpose(cache[0, :, :, 0::2, :], (2, 0, 1, 3))
    v_pages = jnp.transpose(cache[0, :, :, 1::2, :], (2, 0, 1, 3))
    all_pages = random_pages(np.random.default_rng(batch), batch, max_pps)
    sm_scale = d**-0.5

    ours = jax.jit(
        functools.partial(ragged_paged_attention_gpu_stacked, sm_scale=sm_scale, interpret=interpret)
    )
    ours_attn = jax.jit(lambda q, c, kl, pi, cu, ns: ours(q, None, c, jnp.int32(0), kl, pi, cu, ns)[0])
    ours_write = jax.jit(
        lambda q, nkv, c, kl, pi, cu, ns: ours(q, nkv, c, jnp.int32(0), kl, pi, cu, ns), donate_argnums=(2,)
    )
    rows = []
    for ctx in contexts:
        pps = pl_cdiv(ctx, ps)
        pages = jnp.asarray(all_pages[:, :pps])
        kv_lens = jnp.full((batch,), ctx, jnp.int32)
        cu = jnp.arange(batch + 1, dtype=jnp.int32)
        num_seqs = jnp.asarray([batch], jnp.int32)
        kv_bytes = batch * ctx * 2 * hkv * d * dtype.itemsize
        row = dict(batch=batch, context=ctx, kv_bytes=kv_bytes)
        try:
            t = time_calls(ours_attn, q, cache, kv_lens, pages, cu, num_seqs, iters=args.iters)
            row.update(
                ours_ms=t * 1e3, ours_gbps=kv_bytes / t / 1e9, ours_frac_copy_bw=kv_bytes / t / copy_bw
            )
            out_ours = ours_attn(q, cache, kv_lens, pages, cu, num_seqs)
        except Exception as e:  # keep going: one failing size must not hide the rest
            row["ours_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            out_ours = None
        try:
            k_splits = min(16, pps)
            while pps % k_splits:
                k_splits //= 2
            peer = jax.jit(
                functools.partial(jax_paged.paged_attention, k_splits=k_splits, interpret=interpret)
            )
            scaled_q = (q.astype(jnp.float32) * sm_scale).astype(dtype)  # no sm_scale argument
            t = time_calls(peer, scaled_q, k_pages, v_pages, pages, kv_lens, iters=args.iters)
            row.update(jax_ms=t * 1e3, jax_frac_copy_bw=kv_bytes / t / copy_bw)
            out_peer = peer(scaled_q, k_pages, v_pages, pages, kv_lens)
            if out_ours is not None:
                row["max_abs_diff_vs_jax"] = float(
                    jnp.max(jnp.abs(out_ours.astype(jnp.float32) - out_peer.astype(jnp.float32)))
                )
                row["speedup_vs_jax"] = row["jax_ms"] / row["ours_ms"]
        except Exception as e:
            row["jax_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        try:

            def write_step(c):
                return ours_write(q, new_kv, c, kv_lens, pages, cu, num_seqs)[1]

            c = jnp.copy(cache)
            for _ in range(2):
                c = write_step(c)
            jax.block_until_ready(c)
            start = time.perf_counter()
            for _ in range(args.iters):
                c = write_step(c)
            jax.block_until_ready(c)
            row["ours_with_write_ms"] = (time.perf_counter() - start) / args.iters * 1e3
            del c
        except Exception as e:
            row["ours_with_write_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        rows.append(row)
        print(format_row(row), flush=True)
    del cache, k_pages, v_pages
    return rows


HEADER = (
    f"{'batch':>5} {'ctx':>6} {'KV MB':>8} {'ours ms':>9} {'+write':>8} {'jax ms':>9} "
    f"{'speedup':>7} {'ours GB/s':>9} {'ours/copy':>9} {'jax/copy':>8} {'|diff|':>8}"
)


def format_row(r: dict) -> str:
    def f(key, fmt):
        v = r.get(key)
        return format(v, fmt) if v is not None else "-"

    line = (
        f"{r['batch']:>5} {r['context']:>6} {r['kv_bytes'] / 1e6:>8.1f} "
        f"{f('ours_ms', '9.4f'):>9} "
        f"{f('ours_with_write_ms', '8.4f'):>8} {f('jax_ms', '9.4f'):>9} "
        f"{f('speedup_vs_jax', '7.2f'):>7} {f('ours_gbps', '9.1f'):>9} "
        f"{f('ours_frac_copy_bw', '9.1%'):>9} {f('jax_frac_copy_bw', '8.1%'):>8} "
        f"{f('max_abs_diff_vs_jax', '8.1e'):>8}"
    )
    for key in ("ours_error", "jax_error", "ours_with_write_error"):
        if key in r:
            line += f"\n      {key}: {r[key]}"
    return line


def main(argv=None):
    args = parse_args(argv)
    backend = jax.default_backend()
    interpret = backend != "gpu"
    if interpret and not args.smoke:
        sys.exit("no GPU: run with --smoke (interpret mode) or on the GPU machine")
    info = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        jax=jax.__version__,
        backend=backend,
        device=str(jax.devices()[0].device_kind),
        python=platform.python_version(),
        interpret=interpret,
        args=vars(args),
    )
    print(json.dumps(info))

    checks = check_against_reference(args, interpret)
    copy_bw = copy_bandwidth(args.copy_gib, iters=max(2, args.iters // 4))
    print(f"copy bandwidth: {copy_bw / 1e9:.1f} GB/s (read + write of a {args.copy_gib} GiB array)")

    rows = []
    print(HEADER)
    contexts = [int(c) for c in args.contexts.split(",")]
    for batch in (int(b) for b in args.batches.split(",")):
        rows += bench_batch(args, batch, contexts, copy_bw, interpret)

    long_ctx = [r for r in rows if r["context"] == max(contexts) and "ours_frac_copy_bw" in r]
    summary = dict(
        checks_passed=all(c["passed"] for c in checks),
        copy_bandwidth_gbps=copy_bw / 1e9,
        long_context_frac_copy_bw={r["batch"]: r["ours_frac_copy_bw"] for r in long_ctx},
        median_speedup_vs_jax=statistics.median(
            [r["speedup_vs_jax"] for r in rows if "speedup_vs_jax" in r] or [float("nan")]
        ),
    )
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(info=info, checks=checks, summary=summary, rows=rows), f, indent=1)
        print(f"wrote {args.out}")
    return 0 if summary["checks_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

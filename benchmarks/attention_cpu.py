"""The CPU attention path (attention/blocked.py) on steps of a shared-system-prompt workload.

    JAX_PLATFORMS=cpu python benchmarks/attention_cpu.py

Each case is one ragged step of SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head dim
64, 16-token pages) run over ``--layers`` layers of a stacked cache, the sequences' page tables
sharing their first ``--shared-pages`` pages (what prefix caching hands requests with one system
prompt). Timed in the same run, interleaved rep by rep (this shared host's speed drifts by tens of
percent between runs): the defaults; without the narrow blocks for the last stretch of each row's
keys (``tail_kv_pages`` as wide as the widest block); without the cascade pass; and the KV-read
roofline (the distinct KV bytes the step reads, the shared pages once, at the bandwidth a plain
``sum`` over a large array reaches here). Prints medians and ratios; checks that the paths agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.attention.blocked import ragged_paged_attention_blocked

# name -> (query lengths, kv lengths (cache after the step), token slots): decodes, a wave of
# multi-turn prefills over the cached prompt, staggered arrivals (prefills next to decodes), a long
# chunk next to short ones.
CASES = {
    "4 decodes @1.5k": ([1] * 4, [1500] * 4, 4),
    "4 x 72 @1.5k": ([72] * 4, [1496] * 4, 288),
    "3 x ~65 @1.5k": ([58, 59, 75], [1498, 1499, 1499], 192),
    "75 + 3 decodes": ([1, 1, 1, 75], [1500, 1501, 1501, 1499], 80),
    "4 x 30 @1.4k": ([30] * 4, [1438] * 4, 128),
    "415 + 3 x 30": ([415, 30, 30, 30], [1439, 1438, 1438, 1438], 512),
}


def median_time(fn, *args, reps: int) -> float:
    return interleaved_medians({"": fn}, args, reps=reps)[""]


def interleaved_medians(fns: dict, args, *, reps: int) -> dict:
    """Median seconds of each fn(*args), the fns taking turns within every rep (after one warm call)."""
    for fn in fns.values():
        fn(*args).block_until_ready()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def stream_bandwidth(reps: int) -> float:
    """Bytes/s of a jitted sum over 256 MiB of f32 (what streaming the cache can reach here)."""
    x = jnp.ones((64 * 1024 * 1024,), jnp.float32)
    return x.nbytes / median_time(jax.jit(jnp.sum), x, reps=reps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--shared-pages", type=int, default=88, help="leading pages all sequences share")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--cases", nargs="+", choices=list(CASES), help="default: all")
    args = p.parse_args(argv)

    hq, hkv, d, page = 9, 3, 64, 16
    slots, width = 4, 144  # max_num_seqs 4, max_model_len 2304
    rng = np.random.default_rng(0)
    num_pages = slots * width + 1
    kv = jnp.asarray(rng.standard_normal((args.layers, num_pages, page, 2 * hkv, d), dtype=np.float32))
    bandwidth = stream_bandwidth(args.reps)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.layers} layers; "
        f"stream bandwidth {bandwidth / 1e9:.1f} GB/s; {args.shared_pages} shared pages"
    )

    def run_fn(**options):
        @jax.jit
        def run(q, kv, kv_lens, table, cu, num_seqs):
            def layer(i, acc):
                return acc + ragged_paged_attention_blocked(
                    q, kv, kv_lens, table, cu, num_seqs, sm_scale=d**-0.5, layer=i, **options
                )

            return jax.lax.fori_loop(0, args.layers, layer, jnp.zeros_like(q))

        return run

    runs = {"default": run_fn(), "no tail": run_fn(tail_kv_pages=width), "no cascade": run_fn(cascade=False)}
    print(
        "| step | default ms | no tail blocks ms | no cascade ms | tail speed-up | cascade speed-up "
        "| KV roofline ms | default / roofline |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.cases or list(CASES):
        q_lens, kv_lens, tokens = CASES[name]
        n = len(q_lens)
        table = np.zeros((slots, width), np.int32)
        perm = rng.permutation(np.arange(1, num_pages))
        used = 0
        for s, length in enumerate(kv_lens):
            need = -(-length // page)
            table[s, :need] = perm[used : used + need]
            used += need
        table[1:n, : args.shared_pages] = table[0, : args.shared_pages]
        cu = np.zeros(slots + 1, np.int32)
        cu[1 : n + 1] = np.cumsum(q_lens)
        cu[n + 1 :] = cu[n]
        lens = np.zeros(slots, np.int32)
        lens[:n] = kv_lens
        q = jnp.asarray(rng.standard_normal((tokens, hq, d), dtype=np.float32))
        inputs = (q, kv, jnp.asarray(lens), jnp.asarray(table), jnp.asarray(cu), jnp.asarray([n], jnp.int32))
        want = np.asarray(runs["default"](*inputs))
        for other in ("no tail", "no cascade"):
            np.testing.assert_allclose(np.asarray(runs[other](*inputs)), want, rtol=2e-4, atol=2e-4)
        t = interleaved_medians(runs, inputs, reps=args.reps)
        distinct_tokens = sum(kv_lens) - (n - 1) * args.shared_pages * page
        kv_bytes = args.layers * distinct_tokens * 2 * hkv * d * 4
        roof = kv_bytes / bandwidth
        print(
            f"| {name} | {t['default'] * 1e3:.1f} | {t['no tail'] * 1e3:.1f} | "
            f"{t['no cascade'] * 1e3:.1f} | {t['no tail'] / t['default']:.2f}x | "
            f"{t['no cascade'] / t['default']:.2f}x | {roof * 1e3:.1f} | {t['default'] / roof:.1f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

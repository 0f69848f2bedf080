"""Timing helpers shared by the accelerator benchmarks (attention_gpu.py, attention_tpu.py)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def time_calls(fn, *args, iters: int, repeats: int = 3) -> float:
    """Seconds per call: ``iters`` back-to-back async calls, blocked once; best of ``repeats``."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def median_seconds(fn, args, iters: int, repeats: int) -> float:
    """Seconds per call: ``iters`` back-to-back async calls, blocked once; median of ``repeats``."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def time_donating(fn, cache, *args, iters: int, repeats: int = 3):
    """Like ``time_calls`` for ``fn(cache, *args) -> (out, cache)`` that donates its cache.
    Returns (seconds per call, the cache to use next)."""
    out, cache = fn(cache, *args)
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out, cache = fn(cache, *args)
        jax.block_until_ready((out, cache))
        best = min(best, (time.perf_counter() - start) / iters)
    return best, cache


def copy_bandwidth(gib: float, iters: int) -> float:
    """Bytes/s of a device copy (read + write counted), best of a plain copy and x + 1."""
    n = int(gib * 2**30) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: jnp.copy(a))
    add = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))
    t = min(time_calls(copy, x, iters=iters), time_calls(add, x, iters=iters))
    del x
    return 2 * n * 2 / t

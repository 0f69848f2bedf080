"""Chip probe: how XLA:TPU stores candidate KV page shapes, and whether a Pallas kernel reads and
writes them in place through a uint32 view (docs/plans/dense-hd64-cache.md, "to verify first").

For each candidate page shape ``[page_size, *minor]`` (the cache ``[L, P, page_size, *minor]``):
- HBM bytes: ``memory_stats()["bytes_in_use"]`` grown by allocating it, against its logical bytes
  (a minor pair padded to a (16, 128) tile shows up as several times the logical size);
- its ``format`` (XLA's layout and tiling);
- a donated Pallas call that DMAs one page into VMEM, loads word row ``j`` of every token from the
  page's uint32 view (a strided load, as the attention kernel does) and DMAs one new token row into
  the cache: the words must equal the page's bytes read on the host (the byte order within a word
  is what the kernel assumes: the lowest row in the low bits), the token must land, the compiled
  module must hold no copy of the cache, and the call must take microseconds, not a cache copy.

Run on the TPU: ``python benchmarks/tpu_layout_probe.py --out $OUT/layout_probe.json``. On CPU
``--interpret`` runs the kernel in TPU interpret mode (bitcast refs are not supported there, so
only the rank-5 2-D candidates run) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

PAGE_SIZE = 16
LAYERS = 2
TOKEN = 3  # the token row the kernel writes
WORD_ROW = 1  # the word row of each token the kernel loads

# name -> (page minor shape, dtype): the 1B shape's 8 KV heads, head_dim 64.
CANDIDATES = {
    "bf16 today [16,128] (2*Hkv rows, d64 in 128 lanes)": ((16, 128), jnp.bfloat16),
    "bf16 dense rank6 [4,2,128] (K|V a row, 2 heads a word)": ((4, 2, 128), jnp.bfloat16),
    "bf16 dense rank5 [8,128] (K|V a row)": ((8, 128), jnp.bfloat16),
    "f32 dense rank6 [8,1,128]": ((8, 1, 128), jnp.float32),
    "f32 dense rank5 [8,128]": ((8, 128), jnp.float32),
    "u8 dense rank6 [2,4,128] (4 heads a word)": ((2, 4, 128), jnp.uint8),
}


def words_per_token(minor, dtype) -> int:
    """uint32 rows one token's row takes in the page's 32-bit view."""
    itemsize = jnp.dtype(dtype).itemsize
    if len(minor) == 3:
        assert minor[1] * itemsize == 4, (minor, dtype)
        return minor[0]
    return minor[0] * itemsize // 4


def host_words(page: np.ndarray, minor, dtype) -> np.ndarray:
    """[page_size, words, 128] uint32 built from the page's values, lowest row in the low bits."""
    itemsize = jnp.dtype(dtype).itemsize
    bits = page.view(np.dtype(f"uint{8 * itemsize}")).astype(np.uint32)
    per_word = 4 // itemsize
    if len(minor) == 3:  # [ps, R, p, 128]: the p rows of a pair share a word
        grouped = bits
    else:  # [ps, R, 128]: consecutive rows share a word
        grouped = bits.reshape(page.shape[0], minor[0] // per_word, per_word, 128)
    word = np.zeros(grouped.shape[:2] + (128,), np.uint32)
    for i in range(per_word):
        word |= grouped[:, :, i, :] << np.uint32(8 * itemsize * i)
    return word


def probe_call(minor, dtype, num_pages: int, interpret: bool):
    """The donated Pallas call: returns (fn(cache, new_row, page) -> (words, cache))."""
    wpt = words_per_token(minor, dtype)
    rank6 = len(minor) == 3
    flat_minor = (PAGE_SIZE * minor[0], *minor[1:])  # page rows merged with the first minor dim

    def kernel(page_ref, new_ref, cache_in, words_ref, cache_ref, buf, sems):
        del cache_in
        page = page_ref[0]
        copy = pltpu.make_async_copy(cache_ref.at[0, page], buf, sems.at[0])
        copy.start()
        copy.wait()
        view = buf.bitcast(jnp.uint32)
        if rank6:
            view = view.reshape(PAGE_SIZE * minor[0], 128)
        words_ref[...] = view[pl.ds(WORD_ROW, PAGE_SIZE, stride=wpt), :]
        write = pltpu.make_async_copy(
            new_ref, cache_ref.at[0, page, pl.ds(TOKEN * minor[0], minor[0])], sems.at[1]
        )
        write.start()
        write.wait()

    call = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM(flat_minor, dtype), pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((PAGE_SIZE, 128), jnp.uint32),
            jax.ShapeDtypeStruct((LAYERS, num_pages, *flat_minor), dtype),
        ],
        input_output_aliases={2: 1},
        interpret=pltpu.InterpretParams() if interpret else False,
    )

    @jax.jit
    def fn(cache, new_row, page):
        flat = cache.reshape(LAYERS, num_pages, *flat_minor)
        words, flat = call(page, new_row, flat)
        return words, flat.reshape(cache.shape)

    if interpret:
        return jax.jit(fn, donate_argnums=0)
    # In and out row-major (major_to_minor only: XLA keeps its tiling), as the engine pins its
    # cache (kv_cache_format): left to itself XLA may pick another layout and copy around the call.
    from jax.experimental.layout import Format, Layout

    ndim = 2 + 1 + len(minor)
    fmt = Format(
        Layout(major_to_minor=tuple(range(ndim))), jax.sharding.SingleDeviceSharding(jax.devices()[0])
    )
    return jax.jit(fn, donate_argnums=0, in_shardings=(fmt, None, None), out_shardings=(None, fmt))


def bytes_in_use() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use")


def probe(name, minor, dtype, logical_mib: int, interpret: bool) -> dict:
    itemsize = jnp.dtype(dtype).itemsize
    page_bytes = PAGE_SIZE * int(np.prod(minor)) * itemsize
    num_pages = max(8, logical_mib * 2**20 // (LAYERS * page_bytes))
    shape = (LAYERS, num_pages, PAGE_SIZE, *minor)
    row = {"name": name, "shape": list(shape), "dtype": jnp.dtype(dtype).name}
    before = bytes_in_use()
    rng = np.random.default_rng(0)
    host = rng.integers(0, 2**8 * itemsize, size=shape, dtype=np.dtype(f"uint{8 * itemsize}"))
    host = host.view(jnp.dtype(dtype)) if itemsize > 1 else host
    if jnp.dtype(dtype) == jnp.float32:  # finite values only (NaN payloads may be canonicalized)
        host = rng.standard_normal(shape).astype(np.float32)
    cache = jax.device_put(host)
    if not interpret:  # placed as the pinned call wants it: row-major
        from jax.experimental.layout import Format, Layout

        fmt = Format(
            Layout(major_to_minor=tuple(range(host.ndim))),
            jax.sharding.SingleDeviceSharding(jax.devices()[0]),
        )
        cache = jax.device_put(host, fmt)
    cache.block_until_ready()
    after = bytes_in_use()
    row["logical_bytes"] = int(host.nbytes)
    if before is not None and after is not None:
        row["hbm_bytes"] = after - before
        row["hbm_over_logical"] = round((after - before) / host.nbytes, 3)
    try:
        row["format"] = str(cache.format)
    except Exception as err:
        row["format"] = f"unavailable: {err!r}"
    page = 5
    expect = host_words(host[0, page], minor, dtype)[:, WORD_ROW, :]
    new_row = jnp.asarray(host[1, 0, 0])  # some other token's row, same shape
    fn = probe_call(minor, dtype, num_pages, interpret)
    try:
        compiled = fn.lower(cache, new_row, jnp.array([page], jnp.int32)).compile()
        text = compiled.as_text()
        row["hlo_copies"] = sum(1 for line in text.splitlines() if " copy(" in line or "copy-start" in line)
        words, cache = fn(cache, new_row, jnp.array([page], jnp.int32))
        row["words_match"] = bool(np.array_equal(np.asarray(words), expect))
        got = np.asarray(cache[0, page, TOKEN]).view(np.uint8)
        row["write_lands"] = bool(np.array_equal(got, np.asarray(host[1, 0, 0]).view(np.uint8)))
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            words, cache = fn(cache, new_row, jnp.array([page], jnp.int32))
            words.block_until_ready()
            times.append(time.perf_counter() - t0)
        row["call_us_median"] = round(1e6 * float(np.median(times)), 1)
        row["cache_copy_us_at_819GBps"] = round(1e6 * 2 * row.get("hbm_bytes", host.nbytes) / 819e9, 1)
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {str(err)[:800]}"
    del cache
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logical-mib", type=int, default=256, help="logical size of each candidate cache")
    parser.add_argument("--interpret", action="store_true", help="TPU interpret mode (CPU self-check)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for name, (minor, dtype) in CANDIDATES.items():
        if args.interpret and len(minor) == 3:
            continue  # interpret mode cannot index a bitcast ref
        row = probe(name, minor, dtype, args.logical_mib, args.interpret)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

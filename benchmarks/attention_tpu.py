"""TPU ragged paged attention: correctness on the chip, then timings against jax's shipped kernel and
the HBM roofline.

On a TPU machine (JAX_PLATFORMS unset):

    python benchmarks/attention_tpu.py --out /tmp/attention_tpu.json
    python benchmarks/attention_tpu.py --smoke      # tiny sizes; off-TPU the kernels run interpreted

1. Checks our kernel (attention/pallas_tpu.py, compiled by Mosaic) on mixed, decode and prefill
   batches, f32 and bf16, plain and with sliding window + soft cap, and a GQA-3 / head_dim-64 model
   whose cache has padded combined heads. Oracle: jax's own ``ref_ragged_paged_attention`` run on the
   host CPU in f32 over the cache our ``write_kv_ref`` wrote; the kernel's in-kernel KV write must
   equal that cache bit for bit. jax's shipped TPU kernel runs on the same inputs as a second opinion.
2. Measures HBM copy bandwidth (bytes read + written / time of a large device copy).
3. Decode at batch 1/32/128 x context 1k..32k (capped at --max-kv-tokens tokens of KV in all) and two
   prefill-heavy steps: times our kernel attending only, our kernel with its KV write (donated
   cache), and jax's ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (attention only: it
   writes no KV). Reports KV bytes read / time as a fraction of the copy bandwidth and ours / jax.
   --timing-head-dims repeats the timings at other head_dims (e.g. 128,64).
4. tpu-inference's RPA v3 (the kernel vLLM's TPU backend runs; benchmarks/rpa_v3_peer.py loads it
   from its wheel and adapts the inputs) as a third column when its wheel is found (--rpa-v3):
   checked against the same oracle (output and its KV write) where the checks run without sinks,
   and timed at every shape with its default block sizes, cache donated as ours, attending only
   and with its KV write. Ratios are speedups: "ours/RPA" = RPA's time / ours (> 1: ours faster),
   attend-only against attend-only, write against write; "jax/RPA" likewise, attend-only.
   At head_dim 64 the column is v3's head_dim-64 variant, as tpu-inference runs it there
   (``rpa_v3_peer.for_head_dim``): a dense cache, K and V of a head in one 128-lane row, half the
   bytes of ours; it always writes the step's K/V, so it is timed and compared with the write only.
5. FP8 KV cache (--kv-dtype fp8, or bfloat16,fp8 for both): the checks gain an "fp8" dtype (bf16
   queries over a cache of float8_e4m3fn codes stored as uint8, as the engine stores it, k_scale /
   v_scale != 1; oracle: jax's reference on the dequantized f32 cache; the KV write exact byte for
   byte), and every timing shape runs once per KV dtype ("[fp8]" in its name). kv_gbps counts the
   K/V payload (2*Hkv heads x head_dim x itemsize a token); dma_gbps the bytes the kernel really
   moves (the padded C rows x 128-lane rows), which for up to 8 KV heads are the same for fp8 as
   for bf16 (attention/kv_cache_shape.py). jax's kernel and RPA v3 run on bf16 caches only.
6. Writes everything (command, versions, device) as JSON to --out. Exit status 1 if a check (ours
   or RPA v3's) fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

# benchmarks/ only: the repository root would shadow the installed package with its tpuserve/
# folder (the package's top-level modules alone), which is how the TPU machine imports it.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
import rpa_v3_peer
from device_timing import copy_bandwidth, time_calls, time_donating
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as jax_rpa

from tpuserve.attention.kv_cache_shape import combined_heads, device_head_dim, lane_packed_rows
from tpuserve.attention.pallas_tpu import pack_kv_lanes, ragged_paged_attention_tpu_stacked, unpack_kv_lanes
from tpuserve.attention.reference import ragged_paged_attention_ref, write_kv_ref
from tpuserve.kv_cache.layout import kv_cache_format


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write results JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; interpret mode off-TPU")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--contexts", default="1024,4096,16384,32768")
    p.add_argument(
        "--max-kv-tokens",
        type=int,
        default=1 << 20,
        help="skip decode points whose batch x context exceeds this (HBM)",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20, help="timed calls per repeat")
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the bandwidth probe")
    p.add_argument(
        "--check-dtypes",
        default="float32,bfloat16",
        help="KV cache dtypes checked: float32, bfloat16, fp8 (float8_e4m3fn codes stored as uint8)",
    )
    p.add_argument(
        "--kv-dtype",
        default="bfloat16",
        help="KV cache dtypes timed, comma-separated: bfloat16, fp8 (fp8 also joins --check-dtypes; --sweep times bf16 only)",
    )
    p.add_argument(
        "--check-options",
        default=",".join(CHECK_OPTIONS),
        help=f"comma-separated subset of {','.join(CHECK_OPTIONS)}",
    )
    p.add_argument(
        "--timing-head-dims",
        default="",
        help="time at these head_dims (comma-separated; default: --head-dim)",
    )
    p.add_argument(
        "--rpa-v3",
        choices=("auto", "off", "require"),
        default="auto",
        help="tpu-inference's RPA v3 column: when its wheel is found (auto), never, or fail without it",
    )
    p.add_argument(
        "--rpa-v3-dir",
        default=None,
        help="its wheel or unzipped package (default: rpa_v3_peer.find_package's search)",
    )
    p.add_argument("--checks-only", action="store_true")
    p.add_argument(
        "--kv-layout",
        choices=("padded", "lanes"),
        default="padded",
        help="our cache at head_dim 64: padded (2*Hkv rows of 128 lanes) or lanes (pack_kv_lanes: "
        "a head's K | V in one 128-lane row, half the bytes; the engine's for bf16 / f32)",
    )
    p.add_argument(
        "--check-batches",
        default="mixed,decode,prefill",
        help="which checked batches run, comma-separated (a short device call can check one kind)",
    )
    p.add_argument(
        "--fused-chunk-rows",
        default="",
        help="also time the one-item path with every KV head in one matmul pair (fused_heads, "
        "lane-packed layout) at these chunk sizes in cache rows, comma-separated, on decode steps",
    )
    p.add_argument(
        "--fused-items",
        default="4",
        help="tokens a grid step of those fused timings (fused_items), comma-separated",
    )
    p.add_argument(
        "--no-one-item",
        dest="one_item",
        action="store_false",
        help="do not also time the one-item decode path (single_item_decode) on decode steps",
    )
    p.add_argument(
        "--steps",
        default="decode,prefill,mixed",
        help="which timed steps, comma-separated (decode: --batches x --contexts); one chip call "
        "cannot hold them all with RPA v3 beside ours",
    )
    p.add_argument(
        "--sweep", action="store_true", help="only time our kernel over block sizes (no checks, no peers)"
    )
    p.add_argument(
        "--sweep-decode",
        default="",
        help="with --sweep: decode batches BxCTX (comma-separated) timed instead of the default "
        "shapes, over --sweep-bqs x --sweep-page-sizes, each with one KV block per sequence",
    )
    p.add_argument(
        "--sweep-prefill",
        default="",
        help="with --sweep: prefill chunks QxCTX (comma-separated; Q new tokens of one sequence whose "
        "context ends at CTX, e.g. 1024x8192, the last chunk of an 8k prompt) timed over "
        "--sweep-prefill-bqs x --sweep-prefill-ppbs instead of the default shapes",
    )
    p.add_argument("--sweep-prefill-bqs", default="32,64,128,256")
    p.add_argument(
        "--sweep-vmem-mib",
        type=int,
        default=0,
        help="with --sweep: the kernel's scoped VMEM limit in MiB (0: Mosaic's default, 16 MiB on v5e), "
        "so blocks that need more can be timed",
    )
    p.add_argument("--sweep-prefill-ppbs", default="16,32,64")
    p.add_argument("--sweep-bqs", default="1,4,8")
    p.add_argument("--sweep-page-sizes", default="16")
    args = p.parse_args(argv)
    kv_dtypes = [x for x in args.kv_dtype.split(",") if x]
    bad = [x for x in kv_dtypes if x not in KV_DTYPES]
    if bad or not kv_dtypes:
        p.error(f"--kv-dtype: each of {sorted(KV_DTYPES)}, got {args.kv_dtype!r}")
    args.kv_dtypes = kv_dtypes
    checked = [x for x in args.check_dtypes.split(",") if x]
    if "fp8" in kv_dtypes and "fp8" not in checked:
        args.check_dtypes = ",".join(checked + ["fp8"])
    if args.smoke:
        args.batches, args.contexts = "1,2", "64,128"
        args.num_q_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.iters, args.copy_gib = 2, 0.01
    return args


# KV cache dtypes the timings take: the name on the command line -> (cache storage dtype, the
# values' dtype when the storage holds their bytes).
KV_DTYPES = {"bfloat16": (jnp.bfloat16, None), "fp8": (jnp.uint8, jnp.float8_e4m3fn)}
# FP8 checks and timings quantize N(0, 1) data with these (|x| / scale stays far below 448).
FP8_SCALES = dict(k_scale=0.02, v_scale=0.03)


def fp8_codes(x, kv_axis: int = -2):
    """f32 numpy [..., 2*Hkv, D] interleaved K/V -> their float8_e4m3fn codes as uint8 (K rows
    divided by k_scale, V rows by v_scale, clipped to +-448), as quantize_kv writes them."""
    x = np.moveaxis(np.asarray(x, np.float32), kv_axis, -2).copy()
    x[..., 0::2, :] /= FP8_SCALES["k_scale"]
    x[..., 1::2, :] /= FP8_SCALES["v_scale"]
    codes = np.clip(x, -448.0, 448.0).astype(jnp.float8_e4m3fn).view(np.uint8)
    return np.moveaxis(codes, -2, kv_axis)


def fp8_values(codes):
    """uint8 codes [..., 2*Hkv, D] -> the f32 values the cache holds (times the scales)."""
    out = np.asarray(codes).view(jnp.float8_e4m3fn).astype(np.float32)
    out[..., 0::2, :] *= FP8_SCALES["k_scale"]
    out[..., 1::2, :] *= FP8_SCALES["v_scale"]
    return out


def on_tpu() -> bool:
    return jax.devices()[0].platform == "tpu"


def interpret_params():
    return None if on_tpu() else pltpu.InterpretParams(detect_races=False)


def lanes_layout(args, d: int) -> bool:
    """Whether our cache takes the lane-packed layout at this head_dim (``--kv-layout lanes``; an
    FP8 cache too, four heads' codes a 32-bit word)."""
    return args.kv_layout == "lanes" and d == 64


def engine_layout(cache):
    """``cache`` in the device layout the engine gives it (``kv_cache_format``: row-major), and the
    out_shardings that keep a donating call's result there. XLA's own choice for a head_dim-64
    cache is not row-major, and the kernel's call then relayouts the whole cache around itself:
    on a v5e that made our 1B-shape decode look 4.7x slower than RPA v3 here (2026-12-06), where
    the engine's step paid nothing of it."""
    if not on_tpu():
        return cache, None
    fmt = kv_cache_format("pallas_tpu", cache.dtype, cache.sharding)
    return jax.device_put(cache, fmt), (None, fmt)


def step_metadata(seqs: list[tuple[int, int]], page_size: int, slots: int, rng):
    """(kv_lens [slots], page_indices [slots, pps], cu_q_lens [slots+1], num_seqs [1]) as numpy for
    sequences given as (q_len, kv_len); distinct random pages from 1 up, padding slots empty."""
    pps = max(-(-kv // page_size) for _, kv in seqs)
    pages = np.zeros((slots, pps), np.int32)
    perm = rng.permutation(np.arange(1, 1 + len(seqs) * pps)).astype(np.int32)
    pages[: len(seqs)] = perm.reshape(len(seqs), pps)
    q_lens = [q for q, _ in seqs]
    cu = np.full(slots + 1, sum(q_lens), np.int32)
    cu[0], cu[1 : len(seqs) + 1] = 0, np.cumsum(q_lens)
    kv_lens = np.zeros(slots, np.int32)
    kv_lens[: len(seqs)] = [kv for _, kv in seqs]
    return kv_lens, pages, cu, np.asarray([len(seqs)], np.int32), 1 + len(seqs) * pps


CHECK_BATCHES = {
    # (q_len, kv_len) per sequence: decodes, whole prompts, chunks crossing pages, one-token kv.
    "mixed": [(1, 9), (1, 300), (37, 37), (20, 131), (1, 1), (5, 16), (64, 700)],
    "decode": [(1, 2048 - 17 * i) for i in range(8)],
    "prefill": [(256, 256), (128, 1000), (200, 200)],
}
SMOKE_BATCHES = {"mixed": [(1, 9), (7, 7), (5, 21), (1, 1)], "decode": [(1, 60), (1, 17), (1, 3)]}
# Attention options checked, by name: plain, sliding window + soft cap, and gpt-oss's sinks.
_ONE_ITEM_FUSED = dict(
    single_item_decode=True,
    num_queries_per_block=1,
    num_kv_pages_per_block=1 << 16,
    fused_heads=True,
    fused_chunk_rows=256,
)
CHECK_OPTIONS = {
    "plain": dict(),
    "window_cap": dict(sliding_window=64, soft_cap=30.0),
    "sinks": dict(sliding_window=64, sinks=True),
    # the one-item decode path (attention/pallas_tpu.py, single_item_decode): one token a grid
    # step, a KV block as wide as the page table; ours only (the keys in OURS_ONLY)
    "one_item": dict(single_item_decode=True, num_queries_per_block=1, num_kv_pages_per_block=1 << 16),
    # the one-item path with every KV head in one matmul pair (lane-packed layout only; other
    # layouts run the per-head loop), in 256-row chunks so a row of a few pages spans several
    "one_item_fused": _ONE_ITEM_FUSED,
    "one_item_fused_window_cap": dict(_ONE_ITEM_FUSED, sliding_window=40, soft_cap=30.0),
    "one_item_window_cap": dict(
        single_item_decode=True,
        num_queries_per_block=1,
        num_kv_pages_per_block=1 << 16,
        sliding_window=64,
        soft_cap=30.0,
    ),
}
OURS_ONLY = (
    "single_item_decode",
    "num_queries_per_block",
    "num_kv_pages_per_block",
    "fused_heads",
    "fused_chunk_rows",
)


def load_rpa_v3(args):
    """tpu-inference's RPA v3 kernel module and a description, or (None, why not)."""
    if args.rpa_v3 == "off":
        return None, "RPA v3 column off (--rpa-v3 off)"
    try:
        kernel = rpa_v3_peer.load(args.rpa_v3_dir)
    except rpa_v3_peer.PeerUnavailable as e:
        if args.rpa_v3 == "require":
            raise
        return None, f"RPA v3 column skipped: {e}"
    where = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(kernel.__file__))))
    version = rpa_v3_peer.package_version(where)
    if not on_tpu():
        # Its kernel does not run in Pallas's interpret modes (rpa_v3_peer.attention says why).
        return None, f"RPA v3 ({version}) found at {where} but runs compiled on a TPU only: column skipped"
    return kernel, f"RPA v3: tpu-inference {version} from {where}"


def check_rpa_v3(kernel, q, new_kv, cache, md_np, hkv: int, dtype, kw: dict, real: int):
    """RPA v3 on a check's inputs (numpy f32, our order and layout) -> (output [real, Hq, D] in our
    token order, the cache it wrote in our layout [pages, ps, 2*Hkv, D]), both f32 numpy."""
    kernel = rpa_v3_peer.for_head_dim(kernel, q.shape[-1])
    hd64 = rpa_v3_peer.is_hd64(kernel)
    lay = rpa_v3_peer.StepLayout(*md_np, q.shape[0])
    keys, values = rpa_v3_peer.split_new_kv(jnp.asarray(lay.permute_tokens(new_kv), dtype))
    out, peer_cache = rpa_v3_peer.attention(
        kernel,
        jnp.asarray(lay.permute_tokens(q), dtype),
        keys,
        values,
        rpa_v3_peer.to_peer_cache(jnp.asarray(cache, dtype), hkv, hd64=hd64),
        *map(jnp.asarray, lay.metadata()),
        **kw,
    )
    out = lay.restore_tokens(out)[:real]
    got_kv = rpa_v3_peer.from_peer_cache(peer_cache, hkv, cache.shape[-1], hd64=hd64)
    return np.asarray(out.astype(jnp.float32)), np.asarray(got_kv.astype(jnp.float32))


def check_against_oracle(args, rpa_v3=None) -> list[dict]:
    """Our kernel (and jax's, and RPA v3's when loaded) vs jax's ref_ragged_paged_attention in f32
    on the host CPU."""
    rng = np.random.default_rng(0)
    cpu = jax.devices("cpu")[0]
    ps = args.page_size
    models = [(args.num_q_heads, args.num_kv_heads, args.head_dim)]
    if not args.smoke:
        models.append((6, 2, 64))  # GQA 3, head_dim 64: 4 combined heads padded to the sublane tile
    # The sinks case (gpt-oss) has no jax oracle: ours (attention/reference.py, itself tested against
    # transformers' gpt-oss attention on CPU) stands in for it there.
    options = [CHECK_OPTIONS[name] for name in args.check_options.split(",")]
    results = []
    for hq, hkv, d in models:
        batches = SMOKE_BATCHES if args.smoke else CHECK_BATCHES
        for name, seqs in ((n, batches[n]) for n in args.check_batches.split(",") if n in batches):
            for dtype_name in args.check_dtypes.split(","):
                fp8 = dtype_name == "fp8"
                # fp8: bf16 queries and new K/V before quantization, a uint8 cache of e4m3 codes.
                dtype = jnp.dtype(jnp.bfloat16 if fp8 else dtype_name)
                cache_dtype = jnp.dtype(jnp.uint8 if fp8 else dtype)
                for opt in options:
                    kw = dict(sm_scale=d**-0.5, **opt)
                    ours_kw = {k: kw.pop(k) for k in OURS_ONLY if k in kw}
                    if kw.pop("sinks", False):
                        kw["sinks"] = (rng.standard_normal(hq) * 2.0).astype(np.float32)
                    slots = len(seqs) + 1
                    kv_lens, pages, cu, ns, num_pages = step_metadata(seqs, ps, slots, rng)
                    t = int(cu[-1]) + 3  # padding tokens past the last sequence
                    c = combined_heads("pallas_tpu", hkv, cache_dtype)
                    q = rng.standard_normal((t, hq, d)).astype(np.float32)
                    new_kv = rng.standard_normal((t, 2 * hkv, d)).astype(np.float32)
                    cache = np.zeros((num_pages, ps, c, d), np.float32)
                    cache[:, :, : 2 * hkv] = rng.standard_normal((num_pages, ps, 2 * hkv, d))
                    # Round to the dtype first, so the oracle sees exactly the kernel's inputs.
                    q, new_kv, cache = (
                        np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in (q, new_kv, cache)
                    )
                    md_np = (kv_lens, pages, cu, ns)
                    if fp8:  # the cache and this step's K/V as codes; the oracle sees their values
                        cache8 = np.zeros(cache.shape, np.uint8)
                        cache8[:, :, : 2 * hkv] = fp8_codes(cache[:, :, : 2 * hkv])
                        new8 = fp8_codes(new_kv)
                    with jax.default_device(cpu):
                        if fp8:
                            want_kv = write_kv_ref(
                                jnp.asarray(cache8[:, :, : 2 * hkv]),
                                jnp.asarray(new8),
                                *map(jnp.asarray, md_np),
                            )
                            seen = jnp.asarray(fp8_values(want_kv))
                        else:
                            want_kv = write_kv_ref(
                                jnp.asarray(cache[:, :, : 2 * hkv]),
                                jnp.asarray(new_kv),
                                *map(jnp.asarray, md_np),
                            )
                            seen = want_kv
                        oracle = (
                            ragged_paged_attention_ref
                            if "sinks" in kw
                            else jax_rpa.ref_ragged_paged_attention
                        )
                        want = oracle(jnp.asarray(q), seen, *map(jnp.asarray, md_np), **kw)
                        want, want_kv = np.asarray(want), np.asarray(want_kv)
                    md = tuple(jnp.asarray(a) for a in md_np)
                    q_d = jnp.asarray(q, dtype)
                    if fp8:
                        kv_d = jnp.asarray(new8.view(jnp.float8_e4m3fn))
                        cache_d = jnp.asarray(cache8)[None]
                        fp8_kw = dict(kv_dtype=jnp.float8_e4m3fn, **FP8_SCALES)
                    else:
                        kv_d, cache_d, fp8_kw = (
                            jnp.asarray(new_kv, dtype),
                            jnp.asarray(cache, dtype)[None],
                            {},
                        )
                    lanes = lanes_layout(args, d)
                    if lanes:
                        cache_d = pack_kv_lanes(cache_d[:, :, :, : 2 * hkv], hkv)
                    try:
                        out, got_cache = ragged_paged_attention_tpu_stacked(
                            q_d,
                            kv_d,
                            cache_d,
                            jnp.int32(0),
                            *md,
                            interpret=interpret_params(),
                            **kw,
                            **ours_kw,
                            **fp8_kw,
                        )
                        jax.block_until_ready(out)
                    except Exception as e:  # e.g. a Mosaic lowering error: record it, go on
                        msg = f"{type(e).__name__}: {str(e)[:2000]}"
                        print(
                            f"check hq{hq}/hkv{hkv}/d{d} {name} {dtype_name} {opt}: FAILED {msg[:500]}",
                            flush=True,
                        )
                        results.append(
                            dict(
                                model=f"hq{hq}/hkv{hkv}/d{d}",
                                batch=name,
                                dtype=dtype_name,
                                options=str(opt),
                                error=msg,
                                passed=False,
                            )
                        )
                        continue
                    real = int(cu[len(seqs)])
                    got = np.asarray(out[:real].astype(jnp.float32))
                    err = float(np.max(np.abs(got - want[:real])))
                    if lanes:  # back to interleaved heads; padding rows from hkv on
                        rows = got_cache.shape[-2]
                        got_cache = jnp.concatenate(
                            [
                                unpack_kv_lanes(got_cache, hkv),
                                unpack_kv_lanes(got_cache[..., hkv:, :], rows - hkv),
                            ],
                            axis=-2,
                        )
                    got_kv = np.asarray(got_cache[0, :, :, : 2 * hkv].astype(jnp.float32))
                    # (fp8: the uint8 codes themselves, compared as numbers: bit for bit)
                    want_kv_d = np.asarray(jnp.asarray(want_kv, cache_dtype).astype(jnp.float32))
                    kv_exact = bool(np.array_equal(got_kv, want_kv_d))
                    pad_untouched = bool(
                        not np.asarray(got_cache[0, :, :, 2 * hkv :].astype(jnp.float32)).any()
                    )
                    peer_err = None
                    if (
                        on_tpu() and c == 2 * hkv and "sinks" not in kw and not fp8
                    ):  # jax's: unpadded, no sinks
                        try:
                            peer = jax_rpa.ragged_paged_attention(q_d, jnp.asarray(want_kv, dtype), *md, **kw)
                            peer_err = float(
                                np.max(np.abs(np.asarray(peer[:real].astype(jnp.float32)) - want[:real]))
                            )
                        except Exception as e:  # its default blocks can overflow VMEM in f32
                            print(f"  jax's kernel failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    tol = 2e-2 if dtype == jnp.float32 else 6e-2  # fp8: bf16 queries, exact K/V values
                    ok = err <= tol and kv_exact and pad_untouched
                    rpa = {}
                    if rpa_v3 is not None and "sinks" not in kw and not fp8:  # v3's d=128 kernel has no sinks
                        try:
                            rpa_out, rpa_kv = check_rpa_v3(
                                rpa_v3, q, new_kv, cache, md_np, hkv, dtype, kw, real
                            )
                            rpa_err = float(np.max(np.abs(rpa_out - want[:real])))
                            rpa_kv_exact = bool(np.array_equal(rpa_kv, want_kv_d))
                            rpa = dict(
                                rpa_v3_max_abs_err=rpa_err,
                                rpa_v3_kv_write_exact=rpa_kv_exact,
                                rpa_v3_passed=bool(rpa_err <= tol and rpa_kv_exact),
                            )
                        except Exception as e:
                            print(f"  RPA v3 failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                            rpa = dict(
                                rpa_v3_error=f"{type(e).__name__}: {str(e)[:2000]}", rpa_v3_passed=False
                            )
                    results.append(
                        dict(
                            model=f"hq{hq}/hkv{hkv}/d{d}",
                            batch=name,
                            dtype=dtype_name,
                            options=str(opt),
                            max_abs_err=err,
                            tolerance=tol,
                            kv_write_exact=kv_exact,
                            padding_untouched=pad_untouched,
                            jax_kernel_max_abs_err=peer_err,
                            passed=bool(ok),
                            **rpa,
                        )
                    )
                    rpa_note = ""
                    if "rpa_v3_max_abs_err" in rpa:
                        rpa_note = (
                            f" | RPA v3 err {rpa['rpa_v3_max_abs_err']:.2e} kv exact "
                            f"{rpa['rpa_v3_kv_write_exact']} {'PASS' if rpa['rpa_v3_passed'] else 'FAIL'}"
                        )
                    elif rpa:
                        rpa_note = " | RPA v3 FAIL"
                    print(
                        f"check hq{hq}/hkv{hkv}/d{d} {name:7s} {dtype_name:8s} "
                        f"{str(opt):40s} err {err:.2e} (jax's kernel "
                        f"{'-' if peer_err is None else f'{peer_err:.2e}'}) kv exact {kv_exact} "
                        f"{'PASS' if ok else 'FAIL'}{rpa_note}",
                        flush=True,
                    )
    return results


def time_rpa_v3(kernel, base, num_pages: int, hkv: int, q, new_kv, md_np, out_ours, iters: int) -> dict:
    """RPA v3 on one step shape: its cache (v3's layout) tiled from the same random pages as ours,
    donated like ours; attending only (update_kv_cache=False: it then reads every position from the
    cache, as ours attending only does) and with its KV write. Its attend-only output, back in our
    token order, is compared with ours (same cache contents). At head_dim 64 the peer is v3's
    head_dim-64 variant (what tpu-inference runs there), which always writes: timed with the write
    only, its output not compared (the checks compare it with the oracle)."""
    t, hq, d = q.shape
    kernel = rpa_v3_peer.for_head_dim(kernel, d)
    hd64 = rpa_v3_peer.is_hd64(kernel)
    lay = rpa_v3_peer.StepLayout(*md_np, t)
    md = tuple(jnp.asarray(a) for a in lay.metadata())
    q_p = lay.permute_tokens(q)
    keys, values = rpa_v3_peer.split_new_kv(lay.permute_tokens(new_kv))
    cache = jax.jit(
        lambda b: rpa_v3_peer.to_peer_cache(b[jnp.arange(num_pages) % b.shape[0]], hkv, hd64=hd64)
    )(base)
    kv_lens, pages = md_np[0], md_np[1]
    blocks = rpa_v3_peer.default_block_sizes(
        kernel, q.dtype, cache.dtype, hq, hkv, d, base.shape[1], t, len(kv_lens), pages.shape[1]
    )
    row = dict(
        rpa_v3_blocks={k: list(v) for k, v in blocks.items()},
        rpa_v3_distribution=[int(x) for x in lay.distribution],
        rpa_v3_reordered=lay.reordered,
        rpa_v3_kernel="kernel_hd64" if hd64 else "kernel",
        rpa_v3_us=None,
        rpa_v3_matches_ours=None,
    )
    for update in (True,) if hd64 else (False, True):
        fn = jax.jit(
            lambda cache, q, k, v, *md, update=update: rpa_v3_peer.attention(
                kernel, q, k, v, cache, *md, sm_scale=d**-0.5, update_kv_cache=update
            ),
            donate_argnums=(0,),
        )
        secs, cache = time_donating(fn, cache, q_p, keys, values, *md, iters=iters)
        row["rpa_v3_with_kv_write_us" if update else "rpa_v3_us"] = secs * 1e6
        if not update:
            out, cache = fn(cache, q_p, keys, values, *md)
            diff = jnp.abs(lay.restore_tokens(out).astype(jnp.float32) - out_ours.astype(jnp.float32))
            row["rpa_v3_vs_ours_max_abs_diff"] = float(jnp.max(diff))
            # Two bf16 kernels on one cache differ by bf16 rounding; more means a wrong adapter.
            row["rpa_v3_matches_ours"] = row["rpa_v3_vs_ours_max_abs_diff"] <= 6e-2
    del cache
    return row


def timing_point(
    args,
    name: str,
    seqs: list[tuple[int, int]],
    bandwidth: float,
    rng,
    head_dim=None,
    rpa_v3=None,
    kv_dtype: str = "bfloat16",
) -> dict:
    """Time ours (attend only; attend + KV write), jax's kernel and RPA v3 on one step shape.
    ``kv_dtype`` (a KV_DTYPES name): "fp8" times ours over a uint8 cache of e4m3 codes (bf16
    queries), the peers not at all (they would read another cache)."""
    ps, hq, hkv = args.page_size, args.num_q_heads, args.num_kv_heads
    d = head_dim or args.head_dim
    dtype = jnp.bfloat16
    cache_dtype, values = KV_DTYPES[kv_dtype]
    fp8 = values is not None
    c = combined_heads("pallas_tpu", hkv, cache_dtype)
    slots = len(seqs)
    kv_lens, pages, cu, ns, num_pages = step_metadata(seqs, ps, slots, rng)
    md = tuple(jnp.asarray(a) for a in (kv_lens, pages, cu, ns))
    t = int(cu[-1])
    key = jax.random.PRNGKey(len(seqs))
    # Random pages tiled over the cache: values do not change the kernel's speed, and a full-size
    # jax.random.normal would need an f32 temporary twice the cache.
    base = jax.random.normal(key, (min(num_pages, 256), ps, c, d), dtype)
    if fp8:  # e4m3 codes of values ~N(0, 8): a realistic spread of exponents, stored as bytes
        base = jax.lax.bitcast_convert_type((base * 8).astype(values), cache_dtype)
    lanes = lanes_layout(args, d)
    tiled = pack_kv_lanes(base, hkv) if lanes else base
    cache = jax.jit(lambda b: b[jnp.arange(num_pages) % b.shape[0]][None])(tiled)
    cache, pinned = engine_layout(cache)
    q = jax.random.normal(jax.random.fold_in(key, 1), (t, hq, d), dtype)
    new_kv = jax.random.normal(jax.random.fold_in(key, 2), (t, 2 * hkv, d), dtype)
    kw = dict(sm_scale=d**-0.5)
    if fp8:
        new_kv = (new_kv * 8).astype(values)
        kw.update(kv_dtype=values, **FP8_SCALES)
    interp = interpret_params()

    # The kernel updates the cache in place (an aliased output): without donation XLA would copy
    # the whole cache before every call, as the engine never does.
    attend = jax.jit(
        lambda cache, q, *md: ragged_paged_attention_tpu_stacked(
            q, None, cache, jnp.int32(0), *md, num_kv_heads=hkv, interpret=interp, **kw
        ),
        donate_argnums=(0,),
        out_shardings=pinned,
    )
    write = jax.jit(
        lambda cache, q, new_kv, *md: ragged_paged_attention_tpu_stacked(
            q, new_kv, cache, jnp.int32(0), *md, interpret=interp, **kw
        ),
        donate_argnums=(0,),
        out_shardings=pinned,
    )
    t_ours, cache = time_donating(attend, cache, q, *md, iters=args.iters)
    out_ours, cache = attend(cache, q, *md)
    one_item = {}
    # A decode step: also the one-item path, and its fused-heads form at each asked chunk size
    # (lane-packed caches), each checked against ours.
    variants = [("one_item", {})] + [
        (f"fused{rows}x{items}", dict(fused_heads=True, fused_chunk_rows=int(rows), fused_items=int(items)))
        for rows in args.fused_chunk_rows.split(",")
        for items in args.fused_items.split(",")
        if rows and items and lanes and not fp8
    ]
    for tag, extra in variants if args.one_item and t <= slots else []:
        attend_one = jax.jit(
            lambda cache, q, *md, extra=extra: ragged_paged_attention_tpu_stacked(
                q,
                None,
                cache,
                jnp.int32(0),
                *md,
                num_kv_heads=hkv,
                interpret=interp,
                single_item_decode=True,
                **extra,
                **kw,
            ),
            donate_argnums=(0,),
            out_shardings=pinned,
        )
        try:
            t_one, cache = time_donating(attend_one, cache, q, *md, iters=args.iters)
            out_one, cache = attend_one(cache, q, *md)
            diff = float(jnp.max(jnp.abs(out_one.astype(jnp.float32) - out_ours.astype(jnp.float32))))
            one_item.update(
                {f"ours_{tag}_us": t_one * 1e6, f"{tag}_speedup": t_ours / t_one, f"{tag}_max_abs_diff": diff}
            )
            label = "one-item path" if tag == "one_item" else f"one-item, {tag}"
            print(
                f"     {'':24s} {label:17s} {t_one * 1e6:9.1f} us ({t_ours / t_one:5.2f}x ours), max |diff| {diff:.1e}",
                flush=True,
            )
        except Exception as e:  # a Mosaic error: recorded, the other columns still measured
            one_item[f"{tag}_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"  {tag} failed on {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    t_peer = peer_err = peer_blocks = None
    if on_tpu() and c == 2 * hkv and not fp8 and not lanes:
        # jax's kernel reads the cache only (no alias, no copy). Its default blocks overflow v5e's
        # 16 MiB scoped VMEM at these shapes, so smaller KV blocks are tried in turn.
        for blocks in (
            dict(),
            dict(num_kv_pages_per_block=32, num_queries_per_block=32),
            dict(num_kv_pages_per_block=16, num_queries_per_block=16),
            dict(num_kv_pages_per_block=8, num_queries_per_block=8),
        ):
            peer = jax.jit(
                lambda cache, q, *md, b=blocks: jax_rpa.ragged_paged_attention(q, cache[0], *md, **kw, **b)
            )
            try:
                t_peer = time_calls(peer, cache, q, *md, iters=args.iters)
            except Exception as e:
                print(
                    f"  jax's kernel {blocks or 'default blocks'} failed on {name}: "
                    f"{type(e).__name__}: {str(e)[:120]}",
                    flush=True,
                )
                continue
            peer_blocks = blocks or "default"
            peer_err = float(
                jnp.max(jnp.abs(peer(cache, q, *md).astype(jnp.float32) - out_ours.astype(jnp.float32)))
            )
            break
    t_write, cache = time_donating(write, cache, q, new_kv, *md, iters=args.iters)
    del cache
    rpa = {}
    if rpa_v3 is not None and not fp8:
        try:
            rpa = time_rpa_v3(
                rpa_v3, base, num_pages, hkv, q, new_kv, (kv_lens, pages, cu, ns), out_ours, args.iters
            )
        except Exception as e:  # e.g. VMEM at a shape: record it, keep ours and jax's numbers
            print(f"  RPA v3 failed on {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rpa = dict(rpa_v3_error=f"{type(e).__name__}: {str(e)[:2000]}")
    t_rpa, t_rpa_write = rpa.get("rpa_v3_us"), rpa.get("rpa_v3_with_kv_write_us")
    if t_rpa_write is not None:
        rpa["ours_over_rpa_v3"] = None if t_rpa is None else t_rpa / (t_ours * 1e6)
        rpa["ours_over_rpa_v3_with_kv_write"] = t_rpa_write / (t_write * 1e6)
        rpa["jax_over_rpa_v3"] = None if t_peer is None or t_rpa is None else t_rpa / (t_peer * 1e6)
    itemsize = jnp.dtype(cache_dtype).itemsize
    kv_bytes = int(np.sum(kv_lens)) * 2 * hkv * d * itemsize
    # What the DMAs move: whole padded token rows (C combined heads) of whole 128-lane tiles.
    dma_bytes = int(np.sum(kv_lens)) * c * device_head_dim("pallas_tpu", d) * itemsize
    if lanes:  # rows of [K | V], Hkv padded to lane_packed_rows
        dma_bytes = int(np.sum(kv_lens)) * lane_packed_rows(hkv) * 2 * d * itemsize
    flops = 4 * hq * d * sum(q * kv for q, kv in seqs)  # QK^T and PV (causal halves ignored)
    row = dict(
        name=name,
        num_seqs=len(seqs),
        tokens=t,
        kv_tokens=int(np.sum(kv_lens)),
        ours_us=t_ours * 1e6,
        ours_with_kv_write_us=t_write * 1e6,
        jax_us=None if t_peer is None else t_peer * 1e6,
        ours_over_jax=None if t_peer is None else t_peer / t_ours,
        jax_blocks=str(peer_blocks),
        kv_dtype=kv_dtype,
        kv_gbps=kv_bytes / t_ours / 1e9,
        dma_gbps=dma_bytes / t_ours / 1e9,
        roofline_frac=kv_bytes / t_ours / bandwidth,
        tflops=flops / t_ours / 1e12,
        jax_vs_ours_max_abs_diff=peer_err,
        head_dim=d,
        kv_layout="lanes" if lanes else "padded",
        **one_item,
        **rpa,
    )
    print(
        f"time {name:24s} ours {t_ours * 1e6:9.1f} us (+write {t_write * 1e6:9.1f}) "
        f"jax {'-' if t_peer is None else f'{t_peer * 1e6:9.1f}'} us "
        f"speedup {'-' if t_peer is None else f'{t_peer / t_ours:5.2f}'}x  "
        f"KV {row['kv_gbps']:7.1f} GB/s = {row['roofline_frac'] * 100:5.1f}% of copy "
        f"(DMA {row['dma_gbps']:7.1f})  "
        f"{row['tflops']:6.2f} TFLOP/s",
        flush=True,
    )
    if t_rpa_write is not None:

        def ratio(key):
            return "-" if rpa[key] is None else f"{rpa[key]:5.2f}x"

        attend = "-" if t_rpa is None else f"{t_rpa:9.1f}"
        vs_ours = (
            "-"
            if rpa["rpa_v3_matches_ours"] is None
            else f"{rpa['rpa_v3_vs_ours_max_abs_diff']:.1e}{'' if rpa['rpa_v3_matches_ours'] else ' MISMATCH'}"
        )
        print(
            f"     {'':24s} RPA v3 [{rpa['rpa_v3_kernel']}] {attend} us (+write {t_rpa_write:9.1f})  "
            f"ours/RPA {ratio('ours_over_rpa_v3')} (write {ratio('ours_over_rpa_v3_with_kv_write')})  "
            f"jax/RPA {ratio('jax_over_rpa_v3')}  vs ours {vs_ours}  "
            f"blocks d{tuple(rpa['rpa_v3_blocks']['decode'])} m{tuple(rpa['rpa_v3_blocks']['mixed'])} "
            f"dist {tuple(rpa['rpa_v3_distribution'])}",
            flush=True,
        )
    return row


def sweep_block_sizes(args) -> list[dict]:
    """Our kernel (attend only, donated cache) over KV pages per block x queries per block, on a
    long decode batch and a prefill batch: where the per-generation defaults come from."""
    rows = []
    if args.sweep_decode:
        # Short-context decode (a b128 step of 128-token prompts): one KV block per sequence, so
        # the per-sequence cost shows, over queries per block and page sizes.
        for ps in (int(x) for x in args.sweep_page_sizes.split(",")):
            for spec in args.sweep_decode.split(","):
                b, ctx = (int(x) for x in spec.split("x"))
                shape = (
                    f"decode b{b} ctx{ctx} ps{ps}",
                    [(1, ctx)] * b,
                    [int(x) for x in args.sweep_bqs.split(",")],
                )
                rows += _sweep(args, [shape], ps, ppbs=(-(-ctx // ps),))
        return rows
    if args.sweep_prefill:
        # Chunked prefill of one long prompt (the 1 x 8192 MFU point): each chunk's queries over the
        # whole causal context, per queries per block x KV pages per block.
        for spec in args.sweep_prefill.split(","):
            q, ctx = (int(x) for x in spec.split("x"))
            shape = (f"prefill {q}@{ctx}", [(q, ctx)], [int(x) for x in args.sweep_prefill_bqs.split(",")])
            ppbs = tuple(int(x) for x in args.sweep_prefill_ppbs.split(","))
            rows += _sweep(args, [shape], args.page_size, ppbs=ppbs)
        return rows
    shapes = [
        ("decode b32 ctx16k", [(1, 16384)] * 32, (1,)),
        ("prefill 4x512 @4k", [(512, 4096)] * 4, (16, 32, 64, 128)),
    ]
    if args.smoke:
        shapes = [("decode b2 ctx128", [(1, 128)] * 2, (1,)), ("prefill 2x16", [(16, 64)] * 2, (8,))]
    return _sweep(args, shapes, args.page_size, ppbs=(8, 16, 32, 64, 128))


def _sweep(args, shapes, ps: int, ppbs) -> list[dict]:
    hq, hkv, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    rng = np.random.default_rng(2)
    rows = []
    for name, seqs, bqs in shapes:
        kv_lens, pages, cu, ns, num_pages = step_metadata(seqs, ps, len(seqs), rng)
        md = tuple(jnp.asarray(a) for a in (kv_lens, pages, cu, ns))
        c = combined_heads("pallas_tpu", hkv, jnp.bfloat16)
        base = jax.random.normal(jax.random.PRNGKey(0), (min(num_pages, 256), ps, c, d), jnp.bfloat16)
        cache = jax.jit(lambda b: b[jnp.arange(num_pages) % b.shape[0]][None])(base)
        cache, pinned = engine_layout(cache)
        q = jax.random.normal(jax.random.PRNGKey(1), (int(cu[-1]), hq, d), jnp.bfloat16)
        kv_bytes = int(np.sum(kv_lens)) * 2 * hkv * d * 2
        # QK^T and PV over the keys each query token sees (causal: token i of a q-token chunk ending
        # at kv sees kv - q + i + 1 keys)
        flops = 4 * hq * d * sum(q_len * kv - q_len * (q_len - 1) // 2 for q_len, kv in seqs)
        for bq in bqs:
            for ppb in ppbs:
                fn = jax.jit(
                    lambda cache, q, *md, bq=bq, ppb=ppb: ragged_paged_attention_tpu_stacked(
                        q,
                        None,
                        cache,
                        jnp.int32(0),
                        *md,
                        num_kv_heads=hkv,
                        sm_scale=d**-0.5,
                        num_queries_per_block=bq,
                        num_kv_pages_per_block=ppb,
                        vmem_limit_bytes=(args.sweep_vmem_mib << 20) or None,
                        interpret=interpret_params(),
                    ),
                    donate_argnums=(0,),
                    out_shardings=pinned,
                )
                try:
                    t, cache = time_donating(fn, cache, q, *md, iters=args.iters)
                except Exception as e:
                    print(
                        f"sweep {name} bq{bq} ppb{ppb}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True
                    )
                    continue
                rows.append(
                    dict(
                        name=name,
                        bq=bq,
                        pages_per_block=ppb,
                        us=t * 1e6,
                        kv_gbps=kv_bytes / t / 1e9,
                        tflops=flops / t / 1e12,
                    )
                )
                print(
                    f"sweep {name:20s} bq{bq:4d} ppb{ppb:4d}: {t * 1e6:9.1f} us, "
                    f"KV {kv_bytes / t / 1e9:7.1f} GB/s, {flops / t / 1e12:6.2f} TFLOP/s",
                    flush=True,
                )
        del cache
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = jax.devices()[0]
    print(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    rpa_v3 = None
    if not args.sweep:
        try:
            rpa_v3, rpa_v3_note = load_rpa_v3(args)
        except rpa_v3_peer.PeerUnavailable as e:
            print(f"RPA v3 required (--rpa-v3 require) but unavailable: {e}", flush=True)
            return 2
        print(rpa_v3_note, flush=True)
    if args.sweep:
        rows = sweep_block_sizes(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    dict(command=" ".join([sys.executable] + sys.argv), device=dev.device_kind, sweep=rows),
                    f,
                    indent=1,
                )
        return 0
    checks = check_against_oracle(args, rpa_v3)
    rpa_checks = [c for c in checks if "rpa_v3_passed" in c]
    rpa_failed = [c for c in rpa_checks if not c["rpa_v3_passed"]]
    if rpa_v3 is not None:
        print(f"RPA v3: {len(rpa_checks) - len(rpa_failed)}/{len(rpa_checks)} checks passed", flush=True)
        if rpa_failed or not rpa_checks:
            print("RPA v3's timings below are UNVERIFIED (its checks failed or none ran)", flush=True)
    if args.checks_only:
        failed = [c for c in checks if not c["passed"]]
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    dict(
                        command=" ".join([sys.executable] + sys.argv),
                        device=dev.device_kind,
                        rpa_v3=rpa_v3_note,
                        checks=checks,
                    ),
                    f,
                    indent=1,
                )
        print(f"{len(checks) - len(failed)}/{len(checks)} checks passed", flush=True)
        return 1 if failed or rpa_failed else 0
    bandwidth = copy_bandwidth(args.copy_gib, args.iters)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    rng = np.random.default_rng(1)
    timings, points = [], []
    steps = set(args.steps.split(","))
    for b in (int(x) for x in args.batches.split(",")) if "decode" in steps else ():
        for ctx in (int(x) for x in args.contexts.split(",")):
            if b * ctx > args.max_kv_tokens:
                print(f"skip decode b{b} ctx{ctx}: over --max-kv-tokens", flush=True)
                continue
            points.append((f"decode b{b} ctx{ctx}", [(1, ctx)] * b))
    if not args.smoke and "prefill" in steps:
        points.append(("prefill 4x512 @4k", [(512, 4096)] * 4))
    if not args.smoke and "mixed" in steps:
        points.append(("mixed 4x128 @2k + 60 dec", [(128, 2048)] * 4 + [(1, 2048)] * 60))
    result = dict(
        command=" ".join([sys.executable] + sys.argv),
        device=dev.device_kind,
        platform=dev.platform,
        jax=jax.__version__,
        python=platform.python_version(),
        when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        copy_bandwidth_gbps=bandwidth / 1e9,
        rpa_v3=rpa_v3_note,
        rpa_v3_checks_passed=None if rpa_v3 is None else bool(rpa_checks and not rpa_failed),
        checks=checks,
        timings=timings,
    )
    head_dims = [int(x) for x in args.timing_head_dims.split(",") if x] or [args.head_dim]
    for d in head_dims:
        for base_name, seqs in points:
            for kv_dtype in args.kv_dtypes:  # side by side per shape
                name = base_name if len(head_dims) == 1 else f"d{d} {base_name}"
                if kv_dtype != "bfloat16":
                    name = f"{name} [{kv_dtype}]"
                try:
                    timings.append(
                        timing_point(
                            args, name, seqs, bandwidth, rng, head_dim=d, rpa_v3=rpa_v3, kv_dtype=kv_dtype
                        )
                    )
                except Exception as e:  # one failing shape must not cost the rest of a short device lease
                    print(f"time {name}: FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
                    timings.append(
                        dict(
                            name=name,
                            head_dim=d,
                            kv_dtype=kv_dtype,
                            error=f"{type(e).__name__}: {str(e)[:2000]}",
                        )
                    )
            if args.out:  # after every shape: a run cut short by its time limit keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    failed = [c for c in checks if not c["passed"]]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed", flush=True)
    if rpa_v3 is not None:
        print(f"RPA v3: {len(rpa_checks) - len(rpa_failed)}/{len(rpa_checks)} checks passed", flush=True)
    return 1 if failed or rpa_failed else 0


if __name__ == "__main__":
    sys.exit(main())

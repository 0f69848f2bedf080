"""Quantized matmuls on a TPU: the FP8 / MXFP4 / NVFP4 Pallas kernels (quant/pallas_tpu_matmul.py)
compiled by Mosaic and checked against their references on the chip, then a layer scan of a model's
four matmuls (qkv, o, gate_up, down) timed against the same scan in bf16 and against the roofline
of the weight bytes it must read (bytes / 819 GB/s on a v5e).

Each format runs three ways: the records sliced by the scan (what the decoder did before: XLA
materializes each slice for the Pallas call), passed whole with the layer index (what it does now),
and XLA's own dequantize-in-the-fusion path. Weights are random (speed does not depend on values),
made and quantized on the device layer by layer.

    python benchmarks/quant_tpu.py --shape llama-1b --rows 1,8,128 --out q1b.json
    python benchmarks/quant_tpu.py --shape llama-8b --layers 8 --rows 1 --out q8b.json
    python benchmarks/quant_tpu.py --shape tiny --interpret        # CPU: the harness itself
    python benchmarks/quant_tpu.py --shape llama-1b --rows 1,8 --fp4-decode f32,int,swar,swar_bcast

``--fp4-decode``: the FP4 kernels' weight decodes (``pallas_tpu_matmul.FP4_DECODES``) side by
side instead: for each FP4 format and decode, the compiled kernel checked against the reference on
the device, then the layer scan with the records whole (the decoder's way), against bf16 and the
roofline of the quantized bytes. The sliced and XLA ways and FP8 are skipped in that mode.
``swar_tiled`` there is the "swar" decode of records in the tiled K order (``fp4.tile_k_order``):
x enters the kernel as it is, without the column permutation the other SWAR scans run before
each matmul.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from device_timing import median_seconds

from tpuserve.quant import fp4, fp8
from tpuserve.quant.dispatch import quant_linear
from tpuserve.quant.pallas_tpu_matmul import (
    FP4_DECODES,
    fp4_matmul_ref,
    fp4_matmul_tpu,
    fp8_matmul_ref,
    fp8_matmul_tpu,
    tile_records_for_kernel,
)

HBM_BYTES_PER_S = 819e9  # TPU v5e

# (layers, hidden, q heads, kv heads, head_dim, intermediate): the shapes of benchmarks/tpu_e2e.py
SHAPES = {
    "llama-1b": (16, 2048, 32, 8, 64, 8192),
    "llama-8b": (32, 4096, 32, 8, 128, 14336),
    "tiny": (2, 256, 4, 2, 64, 512),
}
FORMATS = {
    "fp8": lambda w: fp8.quantize_fp8(w, "channel"),
    "mxfp4": fp4.quantize_mxfp4,
    "nvfp4": fp4.quantize_nvfp4,
}


def matmul_shapes(hidden, q, kv, hd, inter) -> dict[str, tuple[int, int]]:
    return {
        "qkv": (hidden, (q + 2 * kv) * hd),
        "o": (q * hd, hidden),
        "gate_up": (hidden, 2 * inter),
        "down": (inter, hidden),
    }


def make_layers(shapes, layers: int, quantize, seed: int):
    """{name: weight stacked over layers}: bf16 arrays (quantize None) or records, built one layer
    at a time on the device so only one layer's f32 weights exist at once."""
    out = {}
    for name, (k, n) in shapes.items():
        per_layer = []
        for i in range(layers):
            key = jax.random.PRNGKey(seed * 1000 + i * 10 + len(out))
            w = jax.random.normal(key, (k, n), jnp.float32) / np.sqrt(k)
            per_layer.append(w.astype(jnp.bfloat16) if quantize is None else jax.jit(quantize)(w))
            del w
        out[name] = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        del per_layer
    return out


def weight_bytes(tree) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def chain(mm, h, w_of, q_cols: int, inter: int):
    """One layer's four matmuls, chained as in the decoder (shapes only; no norms or attention)."""
    qkv = mm(h, w_of("qkv"))
    a = mm(qkv[:, :q_cols].astype(h.dtype), w_of("o"))
    gu = mm(a.astype(h.dtype), w_of("gate_up"))
    act = (jax.nn.silu(gu[:, :inter]) * gu[:, inter:]).astype(h.dtype)
    return mm(act, w_of("down")).astype(h.dtype)


def widest_tile(n: int, cap: int) -> int | None:
    """The largest multiple of 128 <= cap dividing n (None: the kernel's own choice)."""
    return next((t for t in range(cap - cap % 128, 0, -128) if n % t == 0), None) if cap else None


def scan_fns(layers: int, q_cols: int, inter: int, interpret, decode=None, max_tn: int = 0):
    """name -> jitted f(h [M, H], weights) -> h, one layer scan each (``decode``, ``max_tn``: the
    FP4 kernels' decode and widest N tile, 0 for their default)."""

    def kernel(x, w, layer=None):
        if isinstance(w, fp8.Fp8Weight):
            return fp8_matmul_tpu(x, w, out_dtype=jnp.float32, layer=layer, interpret=interpret)
        return fp4_matmul_tpu(
            x,
            w,
            out_dtype=jnp.float32,
            layer=layer,
            decode=decode,
            block_n=widest_tile(w.out_features, max_tn),
            interpret=interpret,
        )

    def dense(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    def sliced(h, ws, mm):  # the scan hands each layer its slice
        def body(h, w):
            return chain(mm, h, w.__getitem__, q_cols, inter), None

        return jax.lax.scan(body, h, ws)[0]

    def whole(h, ws, mm):  # the stacks stay whole, the layer index travels
        def body(h, layer):
            return chain(lambda x, w: mm(x, w, layer), h, ws.__getitem__, q_cols, inter), None

        return jax.lax.scan(body, h, jnp.arange(layers, dtype=jnp.int32))[0]

    def xla(x, w, layer):
        return quant_linear(x, w, out_dtype=jnp.float32, impl="xla", layer=layer)

    return {
        "bf16": jax.jit(lambda h, ws: sliced(h, ws, dense)),
        "sliced": jax.jit(lambda h, ws: sliced(h, ws, kernel)),
        "whole": jax.jit(lambda h, ws: whole(h, ws, kernel)),
        "xla": jax.jit(lambda h, ws: whole(h, ws, xla)),
    }


def check_kernels(shapes, quantize, name: str, interpret, seed: int, decode=None) -> dict:
    """One layer per matmul shape: the compiled kernel against the reference (f32 at HIGHEST), both
    on this device, 8 bf16 rows; also the stacked form with a layer index against its slice."""
    errs = {}
    ref = fp8_matmul_ref if name == "fp8" else fp4_matmul_ref
    mm = fp8_matmul_tpu if name == "fp8" else functools.partial(fp4_matmul_tpu, decode=decode)
    for mname, (k, n) in shapes.items():
        w = jax.random.normal(jax.random.PRNGKey(seed), (k, n), jnp.float32) / np.sqrt(k)
        rec = jax.jit(quantize)(w)
        x = jax.random.normal(jax.random.PRNGKey(seed + 1), (8, k), jnp.float32).astype(jnp.bfloat16)
        got = jax.jit(lambda x, r: mm(x, r, out_dtype=jnp.float32, interpret=interpret))(x, rec)
        want = jax.jit(lambda x, r: ref(x.astype(jnp.float32), r, out_dtype=jnp.float32))(x, rec)
        stacked = jax.tree.map(lambda a: jnp.stack([a, a]), rec)
        got1 = jax.jit(lambda x, r: mm(x, r, out_dtype=jnp.float32, layer=jnp.int32(1), interpret=interpret))(
            x, stacked
        )
        scale = float(jnp.max(jnp.abs(want)))
        errs[mname] = {
            "max_rel_err": float(jnp.max(jnp.abs(got - want))) / scale,
            "stacked_equal": bool(jnp.array_equal(got, got1)),
        }
    return errs


# --fp4-decode's extra entry: the "swar" decode of records in the tiled K order (what
# tile_records_for_kernel makes: x then enters the kernel without its SWAR column permutation)
TILED = "swar_tiled"


def compare_fp4_decodes(args, formats, shapes, layers, hidden, q_cols, inter, result) -> dict:
    """For each FP4 format and decode: the on-device check, then the whole-record layer scan per M."""
    from jax.experimental.pallas import tpu as pltpu

    interpret = pltpu.InterpretParams() if args.interpret else None
    decodes = [d for d in args.fp4_decode.split(",") if d]
    unknown = set(decodes) - set(FP4_DECODES) - {TILED}
    if unknown:
        raise SystemExit(f"--fp4-decode: unknown {sorted(unknown)}; known: {FP4_DECODES}")
    rows = [int(r) for r in args.rows.split(",") if r]
    # interpret mode (the tiny shape's K of 256) tiles where the compiled kernel could not
    tile = functools.partial(tile_records_for_kernel, lane_quantum=128 if args.interpret else 512)
    out: dict = {}
    for name in [f for f in formats if f != "fp8"]:
        # one layer per matmul shape, 8 bf16 rows, and its reference (f32 at HIGHEST), shared by
        # every decode's check (the stacked form is what the timed scans run; their outputs are
        # compared across decodes below)
        cases = {}
        for mname, (k, n) in shapes.items():
            w = jax.random.normal(jax.random.PRNGKey(7), (k, n), jnp.float32) / np.sqrt(k)
            rec = jax.jit(FORMATS[name])(w)
            x = jax.random.normal(jax.random.PRNGKey(8), (8, k), jnp.float32).astype(jnp.bfloat16)
            want = jax.jit(lambda x, r: fp4_matmul_ref(x.astype(jnp.float32), r, out_dtype=jnp.float32))(
                x, rec
            )
            cases[mname] = (x, rec, want)
        ws = make_layers(shapes, layers, FORMATS[name], seed=2)
        roof = weight_bytes(ws) / HBM_BYTES_PER_S
        out[name] = {"weight_bytes": weight_bytes(ws), "decodes": {}}
        first_out: dict = {}  # M -> the first decode's scan output
        for decode in decodes:
            res: dict = {"rows": {}, "checks": {}}
            tiled = decode == TILED
            kernel_decode = "swar" if tiled else decode
            try:
                for mname, (x, rec, want) in cases.items():
                    rec = tile(rec) if tiled else rec
                    got = jax.jit(
                        lambda x, r, d=kernel_decode: fp4_matmul_tpu(
                            x, r, out_dtype=jnp.float32, decode=d, interpret=interpret
                        )
                    )(x, rec)
                    err = float(jnp.max(jnp.abs(got - want))) / float(jnp.max(jnp.abs(want)))
                    res["checks"][mname] = {"max_rel_err": err}
                worst = max(c["max_rel_err"] for c in res["checks"].values())
                print(f"{name} decode={decode}: max rel err vs reference {worst:.2e} (4 shapes, 8 rows)")
            except Exception as e:  # a decode Mosaic refuses is reported, the others still run
                res["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                print(f"{name} decode={decode}: FAILED {res['error']}")
                out[name]["decodes"][decode] = res
                continue
            run_ws = tile(ws) if tiled else ws
            for max_tn in [int(t) for t in args.fp4_block_n.split(",") if t]:
                scan = scan_fns(layers, q_cols, inter, interpret, decode=kernel_decode, max_tn=max_tn)[
                    "whole"
                ]
                tn_note = f" tn<={max_tn}" if max_tn else ""
                for m in rows:
                    key = f"{m}" + (f"/tn{max_tn}" if max_tn else "")
                    h = jnp.ones((m, hidden), jnp.bfloat16) * 0.01
                    try:
                        t = median_seconds(scan, (h, run_ws), args.iters, args.repeats)
                        y = np.asarray(scan(h, run_ws), np.float32)
                    except Exception as e:
                        res["rows"][key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                        print(
                            f"{name:6s} decode={decode}{tn_note} M={m}: FAILED {res['rows'][key]['error'][:120]}"
                        )
                        continue
                    ref_y = first_out.setdefault(key, y)  # same weights: the decodes differ by rounding only
                    scan_diff = float(np.max(np.abs(y - ref_y))) / (float(np.max(np.abs(ref_y))) or 1.0)
                    bf16_us = result["bf16"]["rows"][m]["us"]
                    res["rows"][key] = {
                        "scan_vs_first_decode_max_rel": scan_diff,
                        "us": t * 1e6,
                        "roofline_frac": roof / t,
                        "bf16_over": bf16_us / (t * 1e6),
                    }
                    print(
                        f"{name:6s} decode={decode:10s}{tn_note} M={m:4d}: {t * 1e6:8.1f} us ({roof / t:5.1%} of "
                        f"the {roof * 1e6:.1f} us roofline, bf16/this {bf16_us / (t * 1e6):.2f}x; "
                        f"output vs {decodes[0]}'s: {scan_diff:.1e})"
                    )
            out[name]["decodes"][decode] = res
        del ws
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (memory)")
    ap.add_argument("--formats", default="fp8,mxfp4,nvfp4")
    ap.add_argument("--rows", default="1,8,128", help="token rows M of the timed scans")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--fp4-decode",
        default="",
        help=f"compare the FP4 kernels' decodes instead (comma list of {','.join(FP4_DECODES)})",
    )
    ap.add_argument(
        "--fp4-block-n",
        default="0",
        help="with --fp4-decode: widest N tiles to time each decode at (comma list; 0 = the kernel's)",
    )
    ap.add_argument("--interpret", action="store_true", help="TPU interpret mode (CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from jax.experimental.pallas import tpu as pltpu

    interpret = pltpu.InterpretParams() if args.interpret else None
    layers, hidden, q, kv, hd, inter = SHAPES[args.shape]
    layers = args.layers or layers
    shapes = matmul_shapes(hidden, q, kv, hd, inter)
    rows = [int(r) for r in args.rows.split(",") if r]
    fns = scan_fns(layers, q * hd, inter, interpret)
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, shape {args.shape} x {layers} layers, matmuls {shapes}")
    result: dict = {"device": dev.device_kind, "shape": args.shape, "layers": layers, "formats": {}}

    dense = make_layers(shapes, layers, None, seed=1)
    dense_bytes = weight_bytes(dense)
    result["bf16"] = {"weight_bytes": dense_bytes, "rows": {}}
    for m in rows:
        h = jnp.ones((m, hidden), jnp.bfloat16) * 0.01
        t = median_seconds(fns["bf16"], (h, dense), args.iters, args.repeats)
        roof = dense_bytes / HBM_BYTES_PER_S
        result["bf16"]["rows"][m] = {"us": t * 1e6, "roofline_frac": roof / t}
        print(f"bf16   M={m:4d}: {t * 1e6:9.1f} us  roofline {roof * 1e6:8.1f} us  ({roof / t:6.1%})")
    del dense

    formats = [f for f in args.formats.split(",") if f]
    if args.fp4_decode:
        result["fp4_decodes"] = compare_fp4_decodes(
            args, formats, shapes, layers, hidden, q * hd, inter, result
        )
        formats = []
    for name in formats:
        quantize = FORMATS[name]
        res: dict = {"checks": check_kernels(shapes, quantize, name, interpret, seed=7), "rows": {}}
        worst = max(c["max_rel_err"] for c in res["checks"].values())
        same = all(c["stacked_equal"] for c in res["checks"].values())
        print(f"{name}: kernel vs reference on the device, max rel err {worst:.2e}; stacked == 2-D: {same}")
        ws = make_layers(shapes, layers, quantize, seed=2)
        qbytes = weight_bytes(ws)
        res["weight_bytes"] = qbytes
        roof = qbytes / HBM_BYTES_PER_S
        outs = {}
        for m in rows:
            h = jnp.ones((m, hidden), jnp.bfloat16) * 0.01
            row = {}
            for how in ("sliced", "whole", "xla"):
                try:
                    t = median_seconds(fns[how], (h, ws), args.iters, args.repeats)
                    outs[how] = fns[how](h, ws)
                    row[how] = {"us": t * 1e6, "roofline_frac": roof / t}
                except Exception as e:  # a failing variant is reported, the others still run
                    row[how] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            bf16_us = result["bf16"]["rows"][m]["us"]
            res["rows"][m] = row
            cells = "  ".join(
                f"{how} {r['us']:8.1f} us ({r['roofline_frac']:5.1%}, bf16/{how} {bf16_us / r['us']:.2f}x)"
                if "us" in r
                else f"{how} FAILED {r['error'][:80]}"
                for how, r in row.items()
            )
            print(f"{name:6s} M={m:4d}: {cells}  [roofline {roof * 1e6:.1f} us]")
            if "sliced" in outs and "whole" in outs:
                row["whole_equals_sliced"] = bool(jnp.array_equal(outs["sliced"], outs["whole"]))
        result["formats"][name] = res
        del ws
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

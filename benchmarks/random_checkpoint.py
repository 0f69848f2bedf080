"""A random-weight copy of a Hugging Face checkpoint: same config, tokenizer, tensor names and shapes.

For timing on a machine the real weights cannot reach (the lent TPU machine takes 64 MiB of files; a
135M-parameter checkpoint is 0.5 GiB): speed does not depend on the weights' values. Weights are
N(0, 0.02), norm scales 1, float32 (or ``--dtype float16 / bfloat16``).

    python benchmarks/random_checkpoint.py --like MODEL_DIR --shapes-only OUT_DIR   # small: no weights
    python benchmarks/random_checkpoint.py --like OUT_DIR --out RANDOM_DIR          # weights from shapes

``--shapes-only`` copies the config and tokenizer files and writes ``shapes.json`` (tensor name ->
shape, read from the safetensors headers), plus ``dtypes.json`` (name -> safetensors dtype) for the
tensors stored as integers; the second form builds ``model.safetensors`` from a directory holding
either real safetensors files or those files.

Integer tensors are packed quantized data whose bytes the loader reads as they are: gpt-oss's MXFP4
experts (``*_blocks`` u8, two e2m1 codes a byte, any byte valid; ``*_scales`` u8 e8m0 exponents).
They are written from a pool of random bytes (scales kept to 2**-9 .. 2**0, so every weight is
finite and the activations stay in range over many layers), cycled through: a gpt-oss-20b's ~10 GB
of experts would take minutes to draw from a generator, and speed does not depend on the values.
The file is written tensor by tensor, so the host holds one tensor at a time.

``--quantize fp8`` writes the decoder layers' Linear weights pre-quantized, as a compressed-tensors
FP8 checkpoint with per-output-channel scales (what the loader reads without quantizing, and what
lets an 8B shape fit one 16 GB v5e: its bf16 weights alone would fill it). The e4m3 bytes are drawn
directly (exponents 6..7, i.e. magnitudes 0.5..1.9 times a 0.02 channel scale), so an 8B shape's
7 GB of weights take seconds, not the minutes a float RNG and a quantizer would.
``--quantize mxfp4`` writes them as compressed-tensors ``mxfp4-pack-quantized`` instead
(``weight_packed`` u8 ``[out, in/2]`` from the byte pool, ``weight_scale`` e8m0 ``[out, in/32]``
from the scale pool): the 8B shape's MXFP4 weights (3.7 GB) without a quantizer on the chip's host.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import struct
import sys
import time

import ml_dtypes
import numpy as np

SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def tensor_shapes(model_dir: str) -> dict[str, list[int]]:
    """Tensor name -> shape, from ``shapes.json`` or the safetensors headers (no weights read)."""
    path = os.path.join(model_dir, "shapes.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise SystemExit(f"{model_dir}: no shapes.json and no *.safetensors file")
    for name in files:
        with safe_open(name, "np") as f:
            for key in f.keys():
                shapes[key] = list(f.get_slice(key).get_shape())
    return shapes


# safetensors dtype names of what this script writes
_FLOAT_NAMES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
}
_INT_DTYPES = {"U8": np.uint8, "I8": np.int8}
_POOL_BYTES = 256 * 2**20 + 4099  # not a power of two: the cycle does not line up with the tensors
_E8M0_RANGE = (118, 128)  # scale bytes: 2**-9 .. 2**0


def tensor_dtypes(model_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors dtype for the integer tensors (``dtypes.json``, or the headers)."""
    path = os.path.join(model_dir, "dtypes.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    out: dict[str, str] = {}
    for name in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(name, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        out.update(
            {k: v["dtype"] for k, v in header.items() if k != "__metadata__" and v["dtype"] in _INT_DTYPES}
        )
    return out


class _BytePool:
    """Random bytes handed out cyclically (module docstring): ``take(n)`` yields memoryviews."""

    def __init__(self, data: np.ndarray):
        self.data, self.pos = data, 0

    def take(self, n: int):
        while n:
            k = min(n, self.data.size - self.pos)
            yield memoryview(self.data[self.pos : self.pos + k])
            self.pos = (self.pos + k) % self.data.size
            n -= k


def is_layer_linear(name: str, shape) -> bool:
    """A decoder layer's projection weight (``model.layers.N.{self_attn,mlp}.X_proj.weight``)."""
    return ".layers." in name and name.endswith("_proj.weight") and len(shape) == 2


def random_fp8_codes(rng, shape) -> np.ndarray:
    """Random float8_e4m3fn bytes ``[out, in]`` (as u8): sign and 3 mantissa bits random, exponent
    field 6 or 7 (never the NaN pattern)."""
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return (raw & 0x8F) | 0x30  # s 0110|0111 mmm: |value| in [2**-1, 2**0 * 1.875]


MXFP4_BLOCK = 32  # K elements under one e8m0 scale


def mark_compressed_tensors(out_dir: str, method: str) -> None:
    """Add compressed-tensors' ``quantization_config`` to ``config.json``: FP8 per channel
    (``float-quantized``) or MXFP4 (``mxfp4-pack-quantized``, groups of 32)."""
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    if method == "fp8":
        fmt = "float-quantized"
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    else:
        fmt = "mxfp4-pack-quantized"
        weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_BLOCK}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": fmt}},
        "ignore": ["lm_head"],
    }
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)


def write_safetensors(path: str, specs: dict[str, tuple[list[int], str]], fill) -> None:
    """A safetensors file of ``specs`` (name -> (shape, dtype name)); ``fill(name, shape, dtype)``
    yields each tensor's bytes, in order. The format: an 8-byte little-endian header length, the
    JSON header (offsets relative to its end), the data."""
    itemsize = {
        **{v: k.itemsize for k, v in _FLOAT_NAMES.items()},
        **{k: np.dtype(v).itemsize for k, v in _INT_DTYPES.items()},
        "F8_E4M3": 1,
    }
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in specs.items():
        size = math.prod(shape) * itemsize[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (shape, dtype) in specs.items():
            written = 0
            for chunk in fill(name, shape, dtype):
                f.write(chunk)
                written += chunk.nbytes
            if written != header[name]["data_offsets"][1] - header[name]["data_offsets"][0]:
                raise RuntimeError(f"{name}: wrote {written} bytes, header says otherwise")


def copy_small_files(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in SMALL_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--like", required=True, help="checkpoint directory (or a --shapes-only copy)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--shapes-only", metavar="DIR", help="write config, tokenizer and shapes.json here")
    g.add_argument("--out", metavar="DIR", help="write the random-weight checkpoint here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantize", choices=("fp8", "mxfp4"), default=None, help="write the layers' Linears pre-quantized"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16"),
        help="float16 / bfloat16 halve the file and the host memory of a big checkpoint; bfloat16 is "
        "what real models ship (served in bf16, it loads without a cast)",
    )
    args = p.parse_args(argv)
    shapes = tensor_shapes(args.like)
    int_dtypes = tensor_dtypes(args.like)
    if args.shapes_only:
        copy_small_files(args.like, args.shapes_only)
        with open(os.path.join(args.shapes_only, "shapes.json"), "w") as f:
            json.dump(shapes, f)
        if int_dtypes:
            with open(os.path.join(args.shapes_only, "dtypes.json"), "w") as f:
                json.dump(int_dtypes, f)
        print(f"{args.shapes_only}: {len(shapes)} tensor shapes")
        return 0

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    dtype = np.dtype(ml_dtypes.bfloat16 if args.dtype == "bfloat16" else args.dtype)

    def fill(name: str, shape: list[int], kind: str):
        if kind == "F8_E4M3":
            yield random_fp8_codes(rng, shape)
        elif kind == "F32" and name in fp8_scales:
            yield np.full(shape, 0.02, np.float32)
        elif kind in _INT_DTYPES:
            scales = name.endswith(("_scales", ".weight_scale"))
            yield from (scale_pool if scales else pool).take(math.prod(shape))
        elif name.endswith("norm.weight") or len(shape) == 1 and "norm" in name:
            yield np.ones(shape, dtype)
        elif name.endswith(".bias"):
            yield np.zeros(shape, dtype)
        else:
            yield (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)

    specs: dict[str, tuple[list[int], str]] = {}
    fp8_scales: set[str] = set()
    for name, shape in shapes.items():
        if args.quantize == "fp8" and is_layer_linear(name, shape):
            specs[name] = (shape, "F8_E4M3")
            specs[name + "_scale"] = ([shape[0], 1], "F32")
            fp8_scales.add(name + "_scale")
        elif args.quantize == "mxfp4" and is_layer_linear(name, shape):
            out_f, in_f = shape
            if in_f % MXFP4_BLOCK:
                raise SystemExit(f"{name}: {in_f} inputs, not a multiple of MXFP4's {MXFP4_BLOCK}")
            stem = name[: -len("weight")]
            specs[stem + "weight_packed"] = ([out_f, in_f // 2], "U8")
            specs[stem + "weight_scale"] = ([out_f, in_f // MXFP4_BLOCK], "U8")
        else:
            specs[name] = (shape, int_dtypes.get(name, _FLOAT_NAMES[dtype]))
    total_int = sum(math.prod(shape) for shape, kind in specs.values() if kind in _INT_DTYPES)
    # sized to what is needed, up to the pool size; drawn once
    pool = _BytePool(rng.integers(0, 256, min(max(total_int, 1), _POOL_BYTES), dtype=np.uint8))
    scale_pool = _BytePool(
        rng.integers(*_E8M0_RANGE, min(max(total_int // 16, 1), _POOL_BYTES // 16), dtype=np.uint8)
    )
    copy_small_files(args.like, args.out)
    if args.quantize:
        mark_compressed_tensors(args.out, args.quantize)
    path = os.path.join(args.out, "model.safetensors")
    write_safetensors(path, specs, fill)
    print(
        f"{args.out}: {len(specs)} random tensors, {sum(math.prod(v) for v in shapes.values()) / 1e6:.1f}M "
        f"values, {os.path.getsize(path) / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

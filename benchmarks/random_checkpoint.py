"""A random-weight copy of a Hugging Face checkpoint: same config, tokenizer, tensor names and shapes.

For timing on a machine the real weights cannot reach (the lent TPU machine takes 64 MiB of files; a
135M-parameter checkpoint is 0.5 GiB): speed does not depend on the weights' values. Weights are
N(0, 0.02), norm scales 1, float32 (or float16 with ``--dtype float16``).

    python benchmarks/random_checkpoint.py --like MODEL_DIR --shapes-only OUT_DIR   # small: no weights
    python benchmarks/random_checkpoint.py --like OUT_DIR --out RANDOM_DIR          # weights from shapes

``--shapes-only`` copies the config and tokenizer files and writes ``shapes.json`` (tensor name ->
shape, read from the safetensors headers); the second form builds ``model.safetensors`` from a
directory holding either real safetensors files or that ``shapes.json``.

``--quantize fp8`` writes the decoder layers' Linear weights pre-quantized, as a compressed-tensors
FP8 checkpoint with per-output-channel scales (what the loader reads without quantizing, and what
lets an 8B shape fit one 16 GB v5e: its bf16 weights alone would fill it). The e4m3 bytes are drawn
directly (exponents 6..7, i.e. magnitudes 0.5..1.9 times a 0.02 channel scale), so an 8B shape's
7 GB of weights take seconds, not the minutes a float RNG and a quantizer would.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys

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


def copy_small_files(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in SMALL_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def is_layer_linear(name: str, shape) -> bool:
    """A decoder layer's projection weight (``model.layers.N.{self_attn,mlp}.X_proj.weight``)."""
    return ".layers." in name and name.endswith("_proj.weight") and len(shape) == 2


def random_fp8_channel(rng, shape) -> tuple[np.ndarray, np.ndarray]:
    """Random float8_e4m3fn ``[out, in]`` and f32 scales ``[out, 1]``: sign and 3 mantissa bits
    random, exponent field 6 or 7 (never the NaN pattern)."""
    import ml_dtypes

    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes = (raw & 0x8F) | 0x30  # s 0110|0111 mmm: |value| in [2**-1, 2**0 * 1.875]
    return codes.view(ml_dtypes.float8_e4m3fn), np.full((shape[0], 1), 0.02, np.float32)


def mark_compressed_tensors_fp8(out_dir: str) -> None:
    """Add compressed-tensors' FP8 per-channel ``quantization_config`` to ``config.json``."""
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "format": "float-quantized"}
        },
        "ignore": ["lm_head"],
    }
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--like", required=True, help="checkpoint directory (or a --shapes-only copy)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--shapes-only", metavar="DIR", help="write config, tokenizer and shapes.json here")
    g.add_argument("--out", metavar="DIR", help="write the random-weight checkpoint here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantize", choices=("fp8",), default=None, help="write the layers' Linears pre-quantized"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float16"),
        help="float16 halves the file and the host memory of a big checkpoint (the engine casts on load)",
    )
    args = p.parse_args(argv)
    shapes = tensor_shapes(args.like)
    if args.shapes_only:
        copy_small_files(args.like, args.shapes_only)
        with open(os.path.join(args.shapes_only, "shapes.json"), "w") as f:
            json.dump(shapes, f)
        print(f"{args.shapes_only}: {len(shapes)} tensor shapes")
        return 0
    from safetensors.numpy import save_file

    rng = np.random.default_rng(args.seed)
    dtype = np.dtype(args.dtype)
    tensors = {}
    for name, shape in shapes.items():
        if args.quantize == "fp8" and is_layer_linear(name, shape):
            tensors[name], tensors[name + "_scale"] = random_fp8_channel(rng, shape)
        elif name.endswith("norm.weight") or len(shape) == 1 and "norm" in name:
            tensors[name] = np.ones(shape, dtype)
        elif name.endswith(".bias"):
            tensors[name] = np.zeros(shape, dtype)
        else:
            tensors[name] = (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)
    copy_small_files(args.like, args.out)
    if args.quantize == "fp8":
        mark_compressed_tensors_fp8(args.out)
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    print(
        f"{args.out}: {len(tensors)} random tensors, "
        f"{sum(t.size for t in tensors.values()) / 1e6:.1f}M parameters"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A random-weight copy of a Hugging Face checkpoint: same config, tokenizer, tensor names and shapes.

For timing on a machine the real weights cannot reach (the lent TPU machine takes 64 MiB of files; a
135M-parameter checkpoint is 0.5 GiB): speed does not depend on the weights' values. Weights are
N(0, 0.02), norm scales 1, float32 (or float16 with ``--dtype float16``).

    python benchmarks/random_checkpoint.py --like MODEL_DIR --shapes-only OUT_DIR   # small: no weights
    python benchmarks/random_checkpoint.py --like OUT_DIR --out RANDOM_DIR          # weights from shapes

``--shapes-only`` copies the config and tokenizer files and writes ``shapes.json`` (tensor name ->
shape, read from the safetensors headers); the second form builds ``model.safetensors`` from a
directory holding either real safetensors files or that ``shapes.json``.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--like", required=True, help="checkpoint directory (or a --shapes-only copy)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--shapes-only", metavar="DIR", help="write config, tokenizer and shapes.json here")
    g.add_argument("--out", metavar="DIR", help="write the random-weight checkpoint here")
    p.add_argument("--seed", type=int, default=0)
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
        if name.endswith("norm.weight") or len(shape) == 1 and "norm" in name:
            tensors[name] = np.ones(shape, dtype)
        elif name.endswith(".bias"):
            tensors[name] = np.zeros(shape, dtype)
        else:
            tensors[name] = (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)
    copy_small_files(args.like, args.out)
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    print(
        f"{args.out}: {len(tensors)} random tensors, "
        f"{sum(t.size for t in tensors.values()) / 1e6:.1f}M parameters"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

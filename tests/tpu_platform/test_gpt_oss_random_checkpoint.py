"""The benchmark's gpt-oss checkpoints: benchmarks/gpt_oss_shape.py (a gpt-oss-20b shape dir) and
benchmarks/random_checkpoint.py writing MXFP4 experts as random u8 bytes that our loader reads
packed. The 20b shape itself is only checked as numbers (its checkpoint is ~12 GB); the writer
runs end to end on test_gpt_oss.py's tiny MXFP4 checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_gpt_oss as base  # tests/tpu_platform/test_gpt_oss.py: the tiny MXFP4 checkpoint

from tpuserve.quant.fp4 import Mxfp4Weight
from tpuserve.tpu_platform.models.arch import ModelArch

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
checkpoints = base.checkpoints


@pytest.fixture()
def benchmarks(monkeypatch):
    """benchmarks/ on the import path (not a package; gpt_oss_shape imports moe_shape beside it)."""
    monkeypatch.syspath_prepend(os.path.abspath(BENCHMARKS))
    import gpt_oss_shape
    import random_checkpoint

    yield gpt_oss_shape, random_checkpoint
    for name in ("gpt_oss_shape", "random_checkpoint", "moe_shape"):
        sys.modules.pop(name, None)


def test_the_20b_shape_is_the_published_model(benchmarks):
    """Published config fields and every tensor the loader reads, at gpt-oss-20b's sizes: with the
    published vocabulary that is the 20.9 B parameters of openai/gpt-oss-20b, 19.1 B of them in
    experts, whose MXFP4 bytes (4.25 bits a weight) are about 10 GB."""
    shape, _ = benchmarks
    vocab = 201088
    cfg = shape.published_config(vocab, 24, None, 200002)
    arch = ModelArch.from_hf_config(cfg)
    assert (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (2880, 64, 8, 64)
    assert arch.layer_window(0) == 128 and arch.layer_window(1) is None and arch.attention_sinks
    assert arch.moe is not None and (arch.moe.num_experts, arch.moe.top_k) == (32, 4)
    assert arch.rope_attention_factor() > 1.0  # YaRN
    shapes, dtypes = shape.shapes_and_dtypes(shape.dense_names(24), vocab)
    assert shapes["model.layers.23.mlp.experts.gate_up_proj_blocks"] == [32, 5760, 90, 16]
    assert shapes["model.layers.23.mlp.experts.down_proj_scales"] == [32, 2880, 90]
    assert set(dtypes) == {n for n in shapes if n.endswith(("_blocks", "_scales"))} and len(dtypes) == 96
    dense = sum(math.prod(v) for n, v in shapes.items() if n not in dtypes)
    experts = sum(math.prod(v) * 2 for n, v in shapes.items() if n.endswith("_blocks"))
    assert (dense + experts) / 1e9 == pytest.approx(20.9, abs=0.05)
    assert experts / 1e9 == pytest.approx(19.1, abs=0.05)
    packed = sum(math.prod(v) for n, v in shapes.items() if n in dtypes)
    assert packed * 8 / experts == 4.25


@pytest.mark.timeout(300)
def test_random_mxfp4_checkpoint_loads_packed_with_sane_scales(benchmarks, checkpoints, tmp_path):
    """--shapes-only keeps the u8 tensors' dtype (dtypes.json from the headers); --out writes them
    as random bytes, scales in e8m0 118..127; the loader reads them back packed, and a forward
    gives finite logits."""
    _, rc = benchmarks
    shapes_dir, out = str(tmp_path / "shapes"), str(tmp_path / "random")
    assert rc.main(["--like", checkpoints["mxfp4"], "--shapes-only", shapes_dir]) == 0
    with open(os.path.join(shapes_dir, "dtypes.json")) as f:
        dtypes = json.load(f)
    assert dtypes["model.layers.0.mlp.experts.down_proj_blocks"] == "U8" and len(dtypes) == 4 * base.LAYERS
    assert rc.main(["--like", shapes_dir, "--out", out, "--dtype", "float16"]) == 0

    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(out, "model.safetensors"))
    scales = tensors["model.layers.1.mlp.experts.gate_up_proj_scales"]
    blocks = tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    assert scales.dtype == np.uint8 and 118 <= scales.min() and scales.max() <= 127
    assert blocks.dtype == np.uint8 and len(np.unique(blocks)) > 200  # random bytes, every code
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == np.float16

    logits, _ = base.our_last_logits(out)
    assert all(np.isfinite(row).all() for row in logits)
    from tpuserve.tpu_platform.loader import load_model

    rec = load_model(out, jnp.float32).params["layers"][0]["experts_down"]
    assert isinstance(rec, Mxfp4Weight)
    assert all(a.dtype == jnp.uint8 for a in jax.tree_util.tree_leaves(rec))

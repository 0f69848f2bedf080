"""benchmarks/random_checkpoint.py --quantize: the pre-quantized random checkpoints the chip's
end-to-end stages load (the 8B shape fits a 16 GB v5e only quantized). Our loader must read them
as quantized records, as it reads the published formats, and the model must give finite logits."""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.quant.fp4 import Mxfp4Weight
from tpuserve.quant.fp8 import Fp8Weight

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.fixture()
def random_checkpoint(monkeypatch):
    monkeypatch.syspath_prepend(os.path.abspath(BENCHMARKS))
    import random_checkpoint

    yield random_checkpoint
    sys.modules.pop("random_checkpoint", None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method, record", [("mxfp4", Mxfp4Weight), ("fp8", Fp8Weight)])
def test_quantized_random_checkpoint_loads_as_records(
    random_checkpoint, random_checkpoints, tmp_path, method, record
):
    out = str(tmp_path / method)
    assert (
        random_checkpoint.main(["--like", random_checkpoints["llama"], "--out", out, "--quantize", method])
        == 0
    )
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]

    if method == "mxfp4":  # (numpy's safetensors reader has no float8 for the FP8 file)
        from safetensors.numpy import load_file

        tensors = load_file(os.path.join(out, "model.safetensors"))
        packed = tensors["model.layers.1.mlp.down_proj.weight_packed"]
        scale = tensors["model.layers.1.mlp.down_proj.weight_scale"]
        assert packed.dtype == np.uint8 and packed.shape == (64, 64)  # [out, in/2], in = 128
        assert scale.dtype == np.uint8 and scale.shape == (64, 4) and 118 <= scale.min() <= scale.max() <= 127
        assert len(np.unique(packed)) > 200  # random bytes: every code
        assert "model.layers.1.mlp.down_proj.weight" not in tensors

    from tpuserve.tpu_platform.loader import load_model

    model = load_model(out, jnp.float32)
    layers = model.params["layers"]
    layer = layers[0] if isinstance(layers, list) else layers  # unrolled, or stacked [L, ...]
    for name in ("qkv", "o", "gate_up", "down"):
        assert isinstance(layer[name], record), name
    if method == "mxfp4":
        assert all(a.dtype == jnp.uint8 for a in jax.tree_util.tree_leaves(layer["down"]))

    from tpuserve import LLM, SamplingParams

    llm = LLM(out, warmup=False, max_model_len=64, max_num_seqs=2)
    got = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(got[0].outputs[0].token_ids) == 4

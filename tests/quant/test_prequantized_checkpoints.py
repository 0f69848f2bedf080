"""Pre-quantized checkpoints, written by the formats' own libraries, load and match transformers.

Writers (tests/quant/ckpt_writers.py): compressed-tensors' own lifecycle + ``ModelCompressor`` (FP8
per-tensor / per-channel / 128-block, NVFP4, MXFP4) and transformers' own ``Fp8Quantize`` op (HF
``fp8``, 128x128 ``weight_scale_inv``, f32 and UE8M0). Oracle: transformers loading the same
directory on CPU and dequantizing it (``CompressedTensorsConfig(run_compressed=False)``,
``FineGrainedFP8Config(dequantize=True)``), logits in f32.

One caveat, checked rather than hidden: compressed-tensors' NVFP4 decompressor hands transformers
bf16 weights (FP4 x e4m3 / f32 global is not exact in bf16), so for NVFP4 the test asserts that
transformers' weights are exactly ours rounded to bf16, and compares logits against transformers
running compressed-tensors' own f32 ``dequantize`` of the checkpoint tensors.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("compressed_tensors")

import ckpt_writers as cw
import quant_oracle as oracle
from conftest import build_random_checkpoint

from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.tpu_platform.config import ConfigError

PROMPT = "The quick brown fox jumps over the lazy dog again and again, until the sun goes down."
ENGINE = dict(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=24)
# dims divisible by 128 (transformers' Fp8Quantize leaves other shapes unquantized) and, for
# compressed-tensors' blocks, Hkv*D = 128 and F = 384 give whole and partial-free 128-blocks
DIMS = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
FORMATS = {  # name -> (writer, the --quantization family it reports)
    "hf-fp8": (lambda s, d: cw.write_hf_fp8(s, d), "fp8"),
    "hf-fp8-ue8m0": (lambda s, d: cw.write_hf_fp8(s, d, "ue8m0"), "fp8"),
    "ct-FP8": (lambda s, d: cw.write_compressed_tensors(s, d, "FP8"), "fp8"),
    "ct-FP8_DYNAMIC": (lambda s, d: cw.write_compressed_tensors(s, d, "FP8_DYNAMIC"), "fp8"),
    "ct-FP8_BLOCK": (lambda s, d: cw.write_compressed_tensors(s, d, "FP8_BLOCK"), "fp8"),
    "ct-MXFP4": (lambda s, d: cw.write_compressed_tensors(s, d, "MXFP4"), "mxfp4"),
    "ct-NVFP4": (lambda s, d: cw.write_compressed_tensors(s, d, "NVFP4"), "nvfp4"),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_random_checkpoint("llama", str(tmp_path_factory.mktemp("src")), **DIMS)


def _hf(path: str, name: str):
    import transformers

    if name.startswith("hf-"):
        q = transformers.FineGrainedFP8Config(dequantize=True)
    else:
        q = transformers.CompressedTensorsConfig(run_compressed=False)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=q
    ).eval()


@torch.no_grad()
def _ct_nvfp4_f32(model, path: str):
    """Replace each quantized Linear's weight by compressed-tensors' own f32 dequant of the file."""
    import ct_oracle as ct
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    sd = load_file(os.path.join(path, "model.safetensors"))
    for name, m in model.named_modules():
        if name + ".weight_packed" not in sd:
            continue
        out, k = m.weight.shape
        q = unpack_fp4_from_uint8(sd[name + ".weight_packed"], out, k, dtype=torch.float32)
        w = dequantize(
            q,
            sd[name + ".weight_scale"].to(torch.float32),
            args=ct.scheme("NVFP4").weights,
            global_scale=sd[name + ".weight_global_scale"],
            dtype=torch.float32,
        )
        bf16_ours = w.to(torch.bfloat16).float()
        assert torch.equal(m.weight.float(), bf16_ours), name  # transformers' weights = bf16(exact)
        m.weight.copy_(w)
    return model


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(FORMATS))
def test_checkpoint_loads_and_matches_transformers(source, tmp_path, name):
    write, method = FORMATS[name]
    path = write(source, str(tmp_path / name))
    with open(os.path.join(path, "config.json")) as f:
        assert "quantization_config" in json.load(f)
    llm = LLM(path, **ENGINE, warmup=False)
    assert llm.engine.worker.quantization == method
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids, got = out.prompt_token_ids, oracle.engine_prompt_logprobs(out)
    hf = _hf(path, name)
    if name == "ct-NVFP4":
        hf = _ct_nvfp4_f32(hf, path)
    want = oracle.oracle_target_logprobs(oracle.hf_logprobs(hf, ids), ids)
    np.testing.assert_allclose(got, want, atol=1e-4)
    # and the checkpoint really is quantized: the dense source model scores differently
    import transformers

    dense = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    base = oracle.oracle_target_logprobs(oracle.hf_logprobs(dense, ids), ids)
    assert np.abs(got - base).max() > 1e-3
    # the weight memory the worker reports is the quantized records' (under f32 dense)
    n_linear = 2 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 384)
    dense_bytes = sum(p.numel() * 4 for p in dense.parameters())
    budget = 1.1 if method == "fp8" else 0.6  # bytes per weight, scales included
    assert llm.engine.worker.weight_bytes < dense_bytes - n_linear * (4 - budget)


@pytest.mark.timeout(600)
def test_flag_naming_another_format_is_refused(source, tmp_path):
    path = cw.write_compressed_tensors(source, str(tmp_path / "mx"), "MXFP4")
    with pytest.raises(ConfigError, match="already quantized as 'mxfp4'"):
        LLM(path, quantization="fp8", **ENGINE, warmup=False)
    llm = LLM(path, quantization="mxfp4", **ENGINE, warmup=False)  # naming its own format is fine
    assert llm.engine.worker.quantization == "mxfp4"


def test_fp8_bytes_stored_as_u8_load_as_e4m3():
    """Some writers store FP8 weights as U8 bytes: in an FP8 checkpoint they are e4m3 codes, not a
    dense weight of small integers (which the loader once read them as, silently)."""
    import ml_dtypes

    from tpuserve.quant.fp8 import Fp8Weight, dequantize_fp8
    from tpuserve.tpu_platform.loader.quantized import CheckpointQuant, read_linear

    codes = np.random.default_rng(0).integers(0, 256, (64, 32), dtype=np.uint8) & 0xF7  # no NaN codes
    scale = np.full((64, 1), 0.5, np.float32)
    q = CheckpointQuant("fp8", "compressed-tensors")
    for stored in (codes, codes.view(ml_dtypes.float8_e4m3fn)):
        tensors = {"m.weight": stored, "m.weight_scale": scale}
        rec = read_linear(q, "m", tensors.get)
        assert isinstance(rec, Fp8Weight)
        want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32).T * 0.5
        np.testing.assert_array_equal(np.asarray(dequantize_fp8(rec)), want)

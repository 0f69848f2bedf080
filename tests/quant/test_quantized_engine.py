"""``--quantization fp8|mxfp4|nvfp4`` end to end: the engine quantizes a dense checkpoint at load.

Oracles: transformers on the same checkpoint, its projection weights replaced by
* FP8: compressed-tensors' own quantize -> dequantize (per channel), i.e. fully independent: the
  engine's FP8 recipe is compressed-tensors' FP8_DYNAMIC weights bit for bit;
* MXFP4 / NVFP4: the FP4 values the engine chose (its records, dequantized; that dequant is
  bit-exact with torchao in test_quant_formats.py), ungrouped back to q/k/v and gate/up. Online
  FP4 searches each block's scale (quant/search.py), which no oracle library reproduces, so the
  value choice is tested on its own (test_fuse_and_search.py: never worse than the torchao /
  ModelOpt recipe per block) and this test checks everything after it: the records' layout, the
  fused qkv / gate_up, unstacking, and the quantized matmuls inside the engine's forward.
The engine's prompt logprobs must match the oracle tightly, and must differ from the dense model's
(so a no-op quantization fails the test).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

pytest.importorskip("torchao")
pytest.importorskip("compressed_tensors")

import quant_oracle as oracle

from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.tpu_platform.config import ConfigError

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."
ENGINE = dict(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=24)


def _engine_logprobs(path, method):
    llm = LLM(path, quantization=method, **ENGINE, warmup=False)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return llm, out


@pytest.fixture(scope="module")
def dense(random_checkpoints):
    import transformers

    path = random_checkpoints["llama"]
    _, out = _engine_logprobs(path, None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = oracle.oracle_target_logprobs(oracle.hf_logprobs(hf, out.prompt_token_ids), out.prompt_token_ids)
    return path, out.prompt_token_ids, oracle.engine_prompt_logprobs(out), want


@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["fp8", "mxfp4", "nvfp4"])
def test_online_quantization_matches_fake_quantized_transformers(dense, method, caplog):
    import transformers

    path, ids, dense_lp, dense_hf = dense
    np.testing.assert_allclose(dense_lp, dense_hf, atol=1e-4)  # the unquantized baseline agrees
    with caplog.at_level(logging.INFO, logger="tpuserve.tpu_platform.worker"):
        llm, out = _engine_logprobs(path, method)
    assert out.prompt_token_ids == ids
    got = oracle.engine_prompt_logprobs(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if method == "fp8":
        hf = oracle.fake_quantize_hf(hf, method)
    else:
        from tpuserve.quant import fp4

        deq = fp4.dequantize_mxfp4 if method == "mxfp4" else fp4.dequantize_nvfp4
        arch = llm.engine.worker.arch
        hf = oracle.load_engine_weights_into_hf(
            hf, llm.engine.runner.params["layers"], deq, arch.num_heads, arch.num_kv_heads
        )
    want = oracle.oracle_target_logprobs(oracle.hf_logprobs(hf, ids), ids)
    np.testing.assert_allclose(got, want, atol=2e-4)
    # quantization happened (the logprobs moved off the dense ones), and not wildly
    drift = np.abs(got - dense_lp).max()
    assert 1e-3 < drift < 1.0, drift
    # the load logged the weight memory before and after, and the records replaced the weights
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "quantized online" in msg and f"{method}: matmul weights" in msg
    assert llm.engine.worker.quantization == method


@pytest.mark.timeout(300)
def test_unquantizable_method_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="quantization"):
        LLM(None, quantization="awq", warmup=False)

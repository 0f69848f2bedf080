"""A layer scan over quantized weights: the decoder passes the records whole and each layer's
matmul reads its layer in place (tpu_platform/linear.py ``LayerOfStack``).

On a TPU, a scan's per-layer slice of a stacked weight that feeds a Pallas kernel is materialized:
every layer's quantized weight copied out of the stack on every step, ~3x the bytes a decode step
should read (the quantized 1B shape decoded slower than bf16 on the v5e). The guard here is the
mechanism, which CI can see on CPU: the step's scan takes the stacks as constants, not as sliced
inputs, and the scanned engine answers what the unrolled one does.
"""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
from runner_fixtures import assert_layer_scan_takes_whole, scan_runner

from tpuserve.quant import fp4, fp8
from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.tpu_platform.models.quantize import quantize_params


def _weight_arrays(rec) -> list:
    return [rec.qweight] if isinstance(rec, fp8.Fp8Weight) else [rec.packed]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_scan_passes_quantized_records_whole(random_checkpoints, method):
    from tpuserve.tpu_platform.loader import load_model

    path = random_checkpoints["llama"]
    loaded = load_model(path, jnp.float32)
    params, _ = quantize_params(loaded.params, method)
    runner = scan_runner(path, types.SimpleNamespace(arch=loaded.arch, params=params))
    layers = runner.params["layers"]
    recs = [v for v in layers.values() if isinstance(v, (fp8.Fp8Weight, fp4.Mxfp4Weight))]
    assert len(recs) == 4, "qkv, o, gate_up and down should be records"
    stacks = {tuple(a.shape) for rec in recs for a in _weight_arrays(rec)}
    assert_layer_scan_takes_whole(runner, stacks, "quantized stacks")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_scanned_quantized_engine_answers_like_the_unrolled_one(random_checkpoints, method):
    path = random_checkpoints["llama"]
    prompt = "The quick brown fox jumps over the lazy dog, and then it runs far away."
    engine = dict(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=24)
    sp = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    outs = {}
    for loop in ("unroll", "scan"):
        llm = LLM(path, quantization=method, layer_loop=loop, warmup=False, **engine)
        outs[loop] = llm.generate([prompt], sp, use_tqdm=False)[0]
    lp = {
        loop: np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
        for loop, out in outs.items()
    }
    np.testing.assert_allclose(lp["scan"], lp["unroll"], atol=1e-4)
    assert outs["scan"].outputs[0].token_ids == outs["unroll"].outputs[0].token_ids

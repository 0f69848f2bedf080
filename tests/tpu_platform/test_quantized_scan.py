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

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runner_fixtures import scan_runner

from tpuserve.quant import fp4, fp8
from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.tpu_platform.models.quantize import quantize_params


def _scan_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from _scan_eqns(sub)


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
    slices = {s[1:] for s in stacks}
    traced = runner._step.trace(*runner.step_args(runner._empty_batch(1, runner.page_buckets[0])))
    scans = [e for e in _scan_eqns(traced.jaxpr.jaxpr) if e.params["length"] == loaded.arch.num_layers]
    assert scans, "the step has no layer scan"
    for eqn in scans:
        n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
        consts = {tuple(v.aval.shape) for v in eqn.invars[:n_consts]}
        xs_body = eqn.params["jaxpr"].jaxpr.invars[n_consts + n_carry :]
        assert stacks <= consts, f"quantized stacks {stacks} are not scan constants ({consts})"
        assert not slices & {tuple(v.aval.shape) for v in xs_body}, "the scan slices the records"


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

"""Quality of online quantization on the real default model (SmolLM2-135M-Instruct), marked slow.

Perplexity over ``data/prose.txt`` (plain English prose written for this test, ~1.7k tokens), from the
engine's own prompt logprobs: FP8 within 1% of the unquantized model, MXFP4 and NVFP4 within 10%
(NVFP4 no worse than MXFP4); the greedy continuation of "The capital of France is" still starts with
" Paris"; weight bytes of the quantized linear weights FP8 <= 0.52x and FP4 <= 0.30x of bf16.

What is quantized: every decoder layer's q/k/v, o, gate/up and down projections (``quant/params.py``).
FP4 is quantized the default way, by GPTQ over the package's calibration text (a different text);
the round-to-nearest recipe (``quantization_calibration="rtn"``) is measured too, and GPTQ must beat it.
The embedding stays dense: SmolLM2 ties its LM head to it, and it is read as a gather. The byte
ratios are therefore over the quantized linear weights; the whole-model ratio is reported too
(``QuantReport.summary``) and bounded only loosely here.
"""

from __future__ import annotations

import gc
import math
import os

import pytest

from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams

TEXT = os.path.join(os.path.dirname(__file__), "data", "prose.txt")
METHODS = (None, "fp8", "mxfp4", "nvfp4")
RTN = ("mxfp4", "nvfp4")  # also loaded with quantization_calibration="rtn", keyed "<method>:rtn"
# One 2048-token step takes the whole text: fewer shapes to compile than chunked prefill. Layers in
# a scan: the CPU default unrolls all 30, and each of the six engines then compiled its programs
# for ~70 s apiece instead of ~10 s (quality does not depend on how the layers loop).
ENGINE = dict(max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=4, layer_loop="scan")


def perplexity(llm: LLM, text: str) -> tuple[float, int]:
    """exp(mean NLL) of every token of ``text`` after the first, from the engine's prompt logprobs."""
    out = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    nll = [-out.prompt_logprobs[j + 1][t].logprob for j, t in enumerate(ids[1:])]
    return math.exp(sum(nll) / len(nll)), len(ids)


@pytest.fixture(scope="module")
def results():
    with open(TEXT) as f:
        text = f.read()
    res = {}
    for key in (*METHODS, *(f"{m}:rtn" for m in RTN)):
        method, _, calibration = (key or "").partition(":")
        llm = LLM(None, quantization=method or None, quantization_calibration=calibration or "gptq",
                  **ENGINE)
        ppl, n = perplexity(llm, text)
        ans = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)[0].outputs[0].text
        res[key] = dict(ppl=ppl, tokens=n, answer=ans, report=llm.engine.worker.quant_report)
        print(key, f"ppl {ppl:.3f} over {n} tokens, answer {ans!r}",
              res[key]["report"].summary() if method else "")
        del llm
        gc.collect()
    return res


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_text_is_long_enough(results):
    assert 1000 <= results[None]["tokens"] <= 2048


# Measured on this text (CPU, f32 activations): base 19.33; fp8 within 1%; round-to-nearest FP4
# MXFP4 28.7 (+49%) and NVFP4 23.0 (+19%); GPTQ (quant/calibrate.py: MXFP4 with rotated blocks and
# act order) MXFP4 20.92 (+8.2%) and NVFP4 20.63 (+6.7%). GPTQ's MXFP4 moves by up to +-2% between
# CPUs (last-bit differences in the calibration change its rounding path; benchmarks/RESULTS.md).
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("method, budget", [("fp8", 0.01), ("mxfp4", 0.10), ("nvfp4", 0.10)])
def test_perplexity_within_budget(results, method, budget):
    base, ppl = results[None]["ppl"], results[method]["ppl"]
    assert ppl <= base * (1 + budget), (method, ppl, base)
    assert ppl != base  # the weights really changed


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("method", RTN)
def test_gptq_beats_round_to_nearest(results, method):
    assert results[method]["ppl"] < results[f"{method}:rtn"]["ppl"], (results[method]["ppl"],
                                                                      results[f"{method}:rtn"]["ppl"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_nvfp4_no_worse_than_mxfp4(results):
    assert results["nvfp4"]["ppl"] <= results["mxfp4"]["ppl"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("method", METHODS)
def test_still_answers_paris(results, method):
    assert results[method]["answer"].startswith(" Paris"), results[method]["answer"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("method, ratio", [("fp8", 0.52), ("mxfp4", 0.30), ("nvfp4", 0.30)])
def test_weight_bytes(results, method, ratio):
    rep = results[method]["report"]
    assert rep.method == method
    assert rep.ratio_vs_bf16 <= ratio, rep.summary()  # over the quantized linear weights
    # the whole model (dense tied embedding included) shrinks too, by less
    assert rep.total_after < rep.total_before

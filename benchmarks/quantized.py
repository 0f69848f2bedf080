"""Quantized weights benchmark: quality, weight memory and decode speed per format, one run.

    python benchmarks/quantized.py                       # default model, all formats
    python benchmarks/quantized.py --methods fp8 nvfp4 --decode-tokens 64
    python benchmarks/quantized.py --methods mxfp4 mxfp4:rtn nvfp4 nvfp4:rtn  # GPTQ vs round-to-nearest

For the unquantized model and each ``--quantization`` method (online quantization at load):
* quality: perplexity from the engine's prompt logprobs over the quality test's texts, read the way
  tests/quant/test_quantized_quality.py reads them: ``prose.txt`` alone (~1.6k tokens, the text of
  the test's budgets) and with ``prose_more.txt`` (~7.5k tokens, steadier to compare recipes by);
* memory: bytes of the quantized linear weights vs the same elements at bf16, and of all weights
  (the tied embedding stays dense) vs all of them at bf16;
* speed: decode tokens/s on this host's backend (CPU here) for ``--batch`` greedy sequences of
  ``--decode-tokens`` tokens each, after one untimed run that compiles the shapes.
A method may carry ``:gptq`` (the FP4 default) or ``:rtn`` (``--quantization-calibration``); the
load time column includes the calibration. Ratios are against the unquantized row of the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "tests", "quant"))  # the quality test's text and perplexity

from test_quantized_quality import perplexity, prompt_nlls, quality_prompts  # noqa: E402


def decode_tok_s(llm, batch: int, tokens: int) -> float:
    from tpuserve.server.sampling_params import SamplingParams

    prompts = [f"Story number {i}: once upon a time" for i in range(batch)]
    p = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, p, use_tqdm=False)  # compile every shape this workload uses
    t0 = time.perf_counter()
    outs = llm.generate(prompts, p, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def weight_bytes(llm) -> tuple[int, int, int, int]:
    """(quantized linear bytes, their bf16 bytes, all weight bytes, all weights at bf16)."""
    import jax

    w = llm.engine.worker
    params = w.runner.params
    leaves = jax.tree_util.tree_leaves(params)
    total = sum(x.nbytes for x in leaves)
    rep = w.quant_report
    if rep is None:  # unquantized: count the same linear weights' elements
        lin = sum(
            x.size
            for layer in (params["layers"] if isinstance(params["layers"], list) else [params["layers"]])
            for k, x in layer.items()
            if k in ("qkv", "o", "gate_up", "down")
        )
        dense_elems = sum(x.size for x in leaves)
        return lin * 2, lin * 2, dense_elems * 2, dense_elems * 2
    import numpy as np

    dense_elems = (rep.total_before - rep.dense_bytes) // np.dtype(w.dtype).itemsize + rep.bf16_bytes // 2
    return rep.quant_bytes, rep.bf16_bytes, total, dense_elems * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--methods", nargs="+", default=["fp8", "mxfp4", "nvfp4"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()

    import jax

    from tpuserve.server.llm import LLM

    prompts = quality_prompts()
    rows = []
    for spec in [None, *args.methods]:
        method, _, calibration = (spec or "").partition(":")
        kw = dict(quantization=method or None)
        if calibration:
            kw["quantization_calibration"] = calibration
        t0 = time.perf_counter()
        llm = LLM(
            args.model, max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=max(4, args.batch), **kw
        )
        load_s = time.perf_counter() - t0
        nlls = prompt_nlls(llm, prompts)
        ppl, ppl_all = perplexity(nlls[:1]), perplexity(nlls)
        tps = decode_tok_s(llm, args.batch, args.decode_tokens)
        qb, qbf, tb, tbf = weight_bytes(llm)
        rows.append(
            dict(
                method=spec or "none",
                ppl=ppl,
                ppl_all=ppl_all,
                tps=tps,
                qb=qb,
                qbf=qbf,
                tb=tb,
                tbf=tbf,
                load_s=load_s,
            )
        )
        print(
            f"done {spec or 'none'}: ppl {ppl:.3f} (both texts {ppl_all:.3f}), {tps:.1f} tok/s, "
            f"load {load_s:.0f} s",
            flush=True,
        )
        del llm
        gc.collect()

    base = rows[0]
    mib = 1 / 2**20
    print(
        f"\nbackend {jax.default_backend()}, model {args.model or 'SmolLM2-135M-Instruct'}, "
        f"decode {args.batch} x {args.decode_tokens} tokens; "
        f"ppl: prose.txt, all: with prose_more.txt"
    )
    print(
        f"{'method':10} {'ppl':>8} {'ppl/base':>9} {'all ppl':>8} {'all/base':>9} "
        f"{'linear MiB':>11} {'lin/bf16':>9} {'all MiB':>9} {'all/bf16':>9} {'tok/s':>8} "
        f"{'tok/s ratio':>12} {'load s':>7}"
    )
    for r in rows:
        print(
            f"{r['method']:10} {r['ppl']:8.3f} {r['ppl'] / base['ppl']:9.3f} {r['ppl_all']:8.3f} "
            f"{r['ppl_all'] / base['ppl_all']:9.3f} {r['qb'] * mib:11.1f} "
            f"{r['qb'] / r['qbf']:9.3f} {r['tb'] * mib:9.1f} {r['tb'] / r['tbf']:9.3f} "
            f"{r['tps']:8.1f} {r['tps'] / base['tps']:12.2f} {r['load_s']:7.0f}"
        )
    print(
        "(unquantized row: linear and all bytes at bf16, the yardstick; the engine holds them in "
        f"{'f32' if jax.default_backend() == 'cpu' else 'bf16'} on this backend)"
    )


if __name__ == "__main__":
    main()

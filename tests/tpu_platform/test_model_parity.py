"""Numerical parity with transformers (f32, same weights): the oracle we did not write."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_oracle import hf_greedy

from tpuserve.tpu_platform.config import EngineConfig
from tpuserve.tpu_platform.device import discover
from tpuserve.tpu_platform.loader import load_model
from tpuserve.tpu_platform.model_runner import ModelRunner
from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

ARCHS = ["llama", "qwen2", "qwen3"]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "In 2024, 17 researchers published 3 papers on paged attention for TPUs and GPUs alike, "
    "with code, benchmarks and a long discussion of memory bandwidth.",
    "日本語のテキストと emoji 🎉 mixed.",
]


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ARCHS)
def test_last_position_logits_match_transformers(random_checkpoints, arch):
    path = random_checkpoints[arch]
    loaded = load_model(path, jnp.float32)
    runner = ModelRunner(
        EngineConfig.from_kwargs(model=path, max_num_batched_tokens=128),
        loaded.arch,
        loaded.params,
        discover(),
        jnp.float32,
        num_pages=64,
        max_model_len=512,
    )
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts), "want mixed lengths"
    seqs, next_page = [], 1
    for p in prompts:
        n = -(-len(p) // runner.page_size)
        seqs.append(ScheduledSeq(p, 0, list(range(next_page, next_page + n)), SamplingRow()))
        next_page += n
    ours = runner.compute_logits(runner.build_batch(seqs))
    hf = _hf_model(path)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(ours[i], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_64_tokens_match_with_chunking_and_preemption(random_checkpoints, arch):
    """Tiny token budget forces chunked prefill; a tiny page pool forces preemption."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    path = random_checkpoints[arch]
    llm = LLM(
        path,
        max_model_len=128,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_gpu_blocks=12,
        block_size=16,
        warmup=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool should have forced preemption"
    hf = _hf_model(path)
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 64)
        assert out.outputs[0].finish_reason == "length"


@pytest.fixture(scope="module")
def smollm2_hf():
    """transformers' own GGUF loader (its dequantization, not ours) as the oracle for SmolLM2."""
    import os

    from tpuserve.tpu_platform.loader.gguf_loader import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_logits_and_greedy_match_transformers(smollm2_hf):
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    # Layers in a scan: unrolled, each of this test's ~7 programs compiled 30 layer copies (~3 min
    # in all). The unrolled CPU default runs the same model below (the capital-of-France test), and
    # scan == unroll is checked on tiny models (tests/tpu_platform/tp_child.py).
    llm = LLM(
        None,
        max_model_len=256,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_gpu_blocks=20,
        layer_loop="scan",
        warmup=False,
    )
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    runner = llm.engine.runner
    seqs, next_page = [], 1
    for p in prompts:
        n = -(-len(p) // runner.page_size)
        seqs.append(ScheduledSeq(p, 0, list(range(next_page, next_page + n)), SamplingRow()))
        next_page += n
    # One ragged prefill of all prompts (more tokens than the engine's budget: use a wide batch here).
    runner.token_buckets = (64, 128)
    runner.max_num_seqs = 8
    ours = runner.compute_logits(runner.build_batch(seqs))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = smollm2_hf(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(ours[i], ref, rtol=1e-4, atol=1e-4)
    runner.token_buckets = llm.config.token_buckets
    runner.max_num_seqs = 4

    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False
    )
    assert llm.engine.scheduler.num_preemptions > 0
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(smollm2_hf, p, 64)


@pytest.mark.timeout(600)
def test_smollm2_knows_the_capital_of_france():
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = LLM(max_model_len=128, max_num_batched_tokens=32, warmup=False)
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )[0]
    assert out.outputs[0].text.startswith(" Paris")

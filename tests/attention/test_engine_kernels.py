"""End to end: the engine's greedy tokens with the TPU kernel (interpret mode) equal the reference's."""

import pytest

from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_tokens_same_with_pallas_tpu_interpret(tmp_path):
    from conftest import build_random_checkpoint

    path = build_random_checkpoint("qwen3", str(tmp_path / "m"), num_hidden_layers=1)
    prompts = ["Hello world, this is", "A much longer prompt that spans more than one page of KV"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(
        max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2, block_size=16, num_gpu_blocks=16
    )
    ref = LLM(path, attention_impl="reference", **common, warmup=False).generate(
        prompts, params, use_tqdm=False
    )
    ker = LLM(path, attention_impl="pallas_tpu_interpret", **common, warmup=False).generate(
        prompts, params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in ker] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_tokens_same_with_an_fp8_cache_in_the_tpu_kernel(tmp_path):
    """--kv-cache-dtype fp8 on the TPU kernel (interpret mode: the engine's uint8 storage, the
    padded 32-row cache, the in-kernel decode) gives the reference's greedy tokens on the same fp8
    cache. The scales come from the checkpoint, so both engines quantize identically (a calibration
    pass would measure them through each impl's own attention)."""
    import numpy as np
    from conftest import build_random_checkpoint
    from safetensors.numpy import save_file

    path = build_random_checkpoint("qwen3", str(tmp_path / "m"), num_hidden_layers=1)
    scales = {"model.layers.0.self_attn.k_scale": 0.02, "model.layers.0.self_attn.v_scale": 0.01}
    save_file({k: np.asarray(v, np.float32) for k, v in scales.items()}, path + "/kv_scales.safetensors")
    prompts = ["Hello world, this is", "A much longer prompt that spans more than one page of KV"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=2,
        block_size=16,
        num_gpu_blocks=16,
        kv_cache_dtype="fp8",
        warmup=False,
    )
    ref = LLM(path, attention_impl="reference", **common)
    assert ref.engine.runner.kv_scales == pytest.approx((0.02, 0.01))
    want = ref.generate(prompts, params, use_tqdm=False)
    del ref
    llm = LLM(path, attention_impl="pallas_tpu_interpret", **common)
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == np.uint8 and runner.kv_cache.shape[3] == 32  # padded to the tile
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert np.asarray(runner.kv_cache).any()  # the kernel wrote the pages

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

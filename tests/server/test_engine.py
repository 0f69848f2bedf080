"""Engine behaviour on a tiny random-weight Qwen3 with the real Qwen3 tokenizer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.tpu_platform.config import ConfigError, EngineConfig

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def llm(random_checkpoints):
    return LLM(random_checkpoints["qwen3"], max_model_len=256, max_num_batched_tokens=64,
               max_num_seqs=8, num_gpu_blocks=80)


def test_batch_with_bad_request_fails_alone(llm):
    too_long = "word " * 400
    outs = llm.generate(["Hello there", too_long, {"prompt_token_ids": [10**9]}, "Goodbye"],
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 5
    assert "max_model_len" in outs[1].error
    assert "vocabulary" in outs[2].error
    assert outs[3].error is None and len(outs[3].outputs[0].token_ids) == 5


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_tokens=-1), "max_tokens"), (dict(top_p=1.5), "top_p"), (dict(temperature=-1), "temperature"),
    (dict(n=0), "n"), (dict(min_p=2.0), "min_p"), (dict(top_k=-5), "top_k"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"), (dict(repetition_penalty=0.0), "repetition_penalty"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_config_errors_are_clear(random_checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=12)
    with pytest.raises(ConfigError, match="unknown engine argument"):
        EngineConfig.from_kwargs(max_num_seq=3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(random_checkpoints["qwen3"], max_model_len=10**6)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["GPTBigCodeForCausalLM"]}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(bad))


def test_seeded_sampling_reproduces_and_n_gives_distinct_samples(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, n=3, ignore_eos=True)
    a = llm.generate(["Once upon a time"], p, use_tqdm=False)[0]
    # Same request again, now sharing the batch with other work: same tokens.
    b = llm.generate(["Once upon a time", "Other prompt"], [p, SamplingParams(temperature=0.7, seed=5)],
                     use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len(a.outputs) == 3 and len({tuple(o.token_ids) for o in a.outputs}) == 3


def test_stop_token_ids_max_tokens_and_min_tokens(llm):
    greedy = llm.generate(["Count: one two three"], SamplingParams(temperature=0, max_tokens=20,
                                                                   ignore_eos=True), use_tqdm=False)[0]
    ids = greedy.outputs[0].token_ids
    stop_id = ids[5]
    first = ids.index(stop_id)
    out = llm.generate(["Count: one two three"], SamplingParams(temperature=0, max_tokens=20,
                                                                stop_token_ids=[stop_id]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.token_ids == ids[: first + 1]
    # min_tokens bans the stop id until enough tokens are out.
    out = llm.generate(["Count: one two three"], SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[stop_id], min_tokens=first + 2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= first + 2
    assert stop_id not in out.outputs[0].token_ids[: first + 2]


def test_stop_strings_cut_text(llm):
    greedy = llm.generate(["Tell me"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    text = greedy.text
    assert len(text) > 6, text
    stop = text[3:6]
    idx = text.index(stop)
    out = llm.generate(["Tell me"], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:idx]
    out = llm.generate(["Tell me"], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                   include_stop_str_in_output=True, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[: idx + len(stop)]


def test_logprobs_and_prompt_logprobs_are_consistent(llm):
    p = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate(["The sky is blue and the grass"], p, use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    total = 0.0
    for tok, pos in zip(c.token_ids, c.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top token
        assert len(pos) == 3  # the chosen token is also the top-1 entry
        total += pos[tok].logprob
        assert all(lp.logprob <= 0 for lp in pos.values())
    assert math.isclose(total, c.cumulative_logprob, rel_tol=1e-5, abs_tol=1e-5)
    pl = out.prompt_logprobs
    assert pl[0] is None and len(pl) == len(out.prompt_token_ids)
    for tok, pos in zip(out.prompt_token_ids[1:], pl[1:]):
        assert tok in pos and len(pos) in (2, 3)


def test_prompt_logprobs_match_full_logits(llm, random_checkpoints):
    """Prompt logprobs equal transformers' log_softmax at each position (independent oracle)."""
    import torch
    import transformers
    out = llm.generate(["A B C D E F G"], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(random_checkpoints["qwen3"],
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([out.prompt_token_ids])).logits[0], -1).numpy()
    for j, tok in enumerate(out.prompt_token_ids[1:]):
        np.testing.assert_allclose(out.prompt_logprobs[j + 1][tok].logprob, lp[j, tok], atol=1e-4)


def test_abort_frees_pages(llm):
    eng = llm.engine
    idle = eng.pool.num_free
    eng.add_request("a1", "Some long running request", SamplingParams(max_tokens=200, ignore_eos=True))
    eng.add_request("a2", "Another one", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.pool.num_free < idle
    out = eng.abort_request("a1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    eng.abort_request("a2")
    assert eng.pool.num_free == idle and not eng.has_unfinished_requests()


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_steady_state_compiles_nothing_new(random_checkpoints):
    llm = LLM(random_checkpoints["llama"], max_model_len=128, max_num_batched_tokens=32,
              max_num_seqs=4, num_gpu_blocks=40)
    compiled = llm.engine.warmup()
    assert compiled >= len(llm.engine.runner.token_buckets) * len(llm.engine.runner.page_buckets)
    before = llm.engine.runner.compile_count
    rng = np.random.default_rng(0)
    for round_ in range(4):
        n = int(rng.integers(1, 7))
        prompts = [{"prompt_token_ids": rng.integers(0, 1000, int(rng.integers(2, 60))).tolist()}
                   for _ in range(n)]
        params = [SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_p=float(rng.choice([1.0, 0.9])),
                                 max_tokens=int(rng.integers(1, 40)), ignore_eos=True) for _ in prompts]
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.runner.compile_count == before

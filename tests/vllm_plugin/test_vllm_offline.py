"""Offline through vLLM's own API with the plugin active: ``vllm.LLM(model=...)``.

Greedy outputs must equal our standalone engine's and transformers' (f32, same weights), with
vLLM's chunked prefill, preemption and prefix caching all driving our worker; logprobs and prompt
logprobs must match transformers' log_softmax. Each model is served once by vllm_driver.py in a
child process; the oracles run here.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one

import torch
import transformers
from vllm_helpers import PROMPTS, SCAN, hf_greedy, run_driver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PREFIX = (
    "Background notes. The museum opens at nine in the morning and closes at six in the "
    "evening. Tickets cost twelve euros for adults and six for children. The east wing holds "
    "paintings from the seventeenth century, the west wing holds sculpture, and the basement "
    "holds a collection of old maps, clocks and scientific instruments. Guided tours leave "
    "every hour from the main hall. "
)
QUESTIONS = ["Question: When does the museum open?\nAnswer:", "Question: What is in the basement?\nAnswer:"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SEEDED = dict(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """log_softmax of the logits at every position of ``ids`` ([len, V])."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()


def ours(path, prompts, max_tokens, chat=None, **engine):
    """Our standalone engine (server.llm.LLM) on the same weights: token ids per prompt."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = LLM(path, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    chat_ids = None
    if chat is not None:
        chat_ids = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
        chat_ids = list(chat_ids.outputs[0].token_ids)
    return [list(t) for t in out], chat_ids


@pytest.fixture(scope="module")
def smol(default_hf_dir, tmp_path_factory):
    greedy = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
    spec = {
        # A 12-page pool (page 0 is vLLM's null block) for 4 sequences needing 15 pages at full
        # length forces preemption; a 32-token step budget chunks every longer prompt (the third
        # one, the shared-prefix ones).
        "engine": dict(
            model=default_hf_dir,
            dtype="float32",
            max_model_len=160,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=13,
            seed=0,
            enable_prefix_caching=True,
            disable_log_stats=False,
            additional_config={"warmup": True, **SCAN},
        ),  # warm-up is off by default on CPU
        "jobs": [
            {"kind": "generate", "prompts": PROMPTS, "params": dict(greedy, logprobs=2)},
            {
                "kind": "generate",
                "prompts": [PROMPTS[2]],
                "params": dict(temperature=0.0, max_tokens=1, prompt_logprobs=2),
            },
            {"kind": "metrics"},
            {"kind": "generate", "prompts": [PREFIX + QUESTIONS[0]], "params": dict(greedy, max_tokens=16)},
            {"kind": "generate", "prompts": [PREFIX + QUESTIONS[1]], "params": dict(greedy, max_tokens=16)},
            {"kind": "metrics"},
            {"kind": "chat", "messages": CHAT, "params": dict(temperature=0.0, max_tokens=16)},
            {
                "kind": "generate",
                "prompts": ["Is the sky blue? Answer:"],
                "params": dict(
                    temperature=0.0, max_tokens=8, structured_outputs={"choice": ["maybe", "never"]}
                ),
            },
            {"kind": "generate", "prompts": PROMPTS[:2], "params": SEEDED},
            {"kind": "generate", "prompts": PROMPTS[:2][::-1], "params": SEEDED},
        ],
    }
    return run_driver(spec, str(tmp_path_factory.mktemp("vllm-smol")))


@pytest.fixture(scope="module")
def smol_hf(default_hf_dir):
    return hf_model(default_hf_dir)


@pytest.fixture(scope="module")
def smol_ours(smol, default_hf_dir):
    """Our standalone engine on the vLLM run's prompt ids (greedy) and its chat prompt."""
    prompt_ids = [r["prompt_token_ids"] for r in smol["jobs"][0]["out"]]
    return ours(
        default_hf_dir,
        [{"prompt_token_ids": p} for p in prompt_ids],
        32,
        chat=CHAT,
        max_model_len=160,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        layer_loop="scan",
    )


def test_plugin_was_the_platform(smol):
    assert smol["platform"] == "TpuservePlatform"
    assert "tpuserve vLLM platform active" in smol["log"]
    assert "tpuserve worker on JAX cpu" in smol["log"]
    assert "warm-up compiled" in smol["log"]
    assert "decoder layers: scan" in smol["log"]  # --additional-config reached the runner


def test_smollm2_greedy_equals_ours_and_transformers_through_preemption(smol, smol_ours, smol_hf):
    recs = smol["jobs"][0]["out"]
    prompt_ids = [r["prompt_token_ids"] for r in recs]
    hf = smol_hf
    for r, p, m in zip(recs, prompt_ids, smol_ours[0]):
        assert r["token_ids"] == m, "vLLM+plugin vs our standalone engine"
        assert r["token_ids"] == hf_greedy(hf, p, 32), "vLLM+plugin vs transformers"
    counters = smol["jobs"][2]["out"]
    assert counters["vllm:num_preemptions"] > 0, "the 12-page pool should have forced preemption"


def test_smollm2_logprobs_match_transformers(smol, smol_hf):
    hf = smol_hf
    for r in smol["jobs"][0]["out"][:2]:
        ids = r["prompt_token_ids"] + r["token_ids"]
        ref = hf_logprobs(hf, ids)
        p = len(r["prompt_token_ids"])
        assert len(r["logprobs"]) == len(r["token_ids"])
        for i, (tok, pos) in enumerate(zip(r["token_ids"], r["logprobs"])):
            row = ref[p - 1 + i]
            assert len(pos) in (2, 3)  # the sampled token plus the top 2 (it is one of them here)
            np.testing.assert_allclose(pos[str(tok)], row[tok], atol=2e-3)
            top2 = np.argsort(-row)[:2]
            for t in top2:
                np.testing.assert_allclose(pos[str(int(t))], row[t], atol=2e-3)


def test_smollm2_prompt_logprobs_match_transformers(smol, smol_hf):
    r = smol["jobs"][1]["out"][0]
    ids = r["prompt_token_ids"]
    ref = hf_logprobs(smol_hf, ids)
    pl = r["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)  # vLLM's shape: nothing for the first token
    for p in range(1, len(ids)):
        np.testing.assert_allclose(pl[p][str(ids[p])], ref[p - 1][ids[p]], atol=2e-3)
        best = int(np.argmax(ref[p - 1]))
        np.testing.assert_allclose(pl[p][str(best)], ref[p - 1][best], atol=2e-3)


def test_prefix_cache_hit_reports_cached_tokens_and_same_text(smol, smol_hf):
    first, second = smol["jobs"][3]["out"][0], smol["jobs"][4]["out"][0]
    assert first["num_cached_tokens"] == 0
    # The shared prefix spans several full 16-token pages: vLLM found them in its prefix cache.
    assert second["num_cached_tokens"] >= 64, second["num_cached_tokens"]
    before, after = smol["jobs"][2]["out"], smol["jobs"][5]["out"]
    assert after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"] >= second["num_cached_tokens"]
    # Same greedy text as a run that computes the whole prompt: transformers.
    hf = smol_hf
    assert second["token_ids"] == hf_greedy(hf, second["prompt_token_ids"], 16)
    assert first["token_ids"] == hf_greedy(hf, first["prompt_token_ids"], 16)


def test_chat_matches_our_engine(smol, smol_ours):
    r = smol["jobs"][6]["out"][0]
    assert r["token_ids"] == smol_ours[1]
    assert "Paris" in r["text"]


def test_structured_output_bitmask_reaches_our_sampler(smol):
    # Neither choice is what the model would say unconstrained: only vLLM's grammar bitmask,
    # applied by our sampler, can produce one of them.
    assert smol["jobs"][7]["out"][0]["text"] in ("maybe", "never")


def test_seeded_sampling_reproduces_whatever_the_batch(smol):
    first, second = smol["jobs"][8]["out"], smol["jobs"][9]["out"][::-1]
    assert [r["token_ids"] for r in first] == [r["token_ids"] for r in second]
    assert first[0]["token_ids"] != first[1]["token_ids"]


@pytest.fixture(scope="module")
def qwen3(qwen3_dir, tmp_path_factory):
    spec = {
        "engine": dict(
            model=qwen3_dir,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            num_gpu_blocks_override=12,
            block_size=16,
            seed=0,
            disable_log_stats=False,
        ),
        "jobs": [
            {
                "kind": "generate",
                "prompts": PROMPTS,
                "params": dict(temperature=0.0, max_tokens=64, ignore_eos=True),
            },
            {"kind": "metrics"},
        ],
    }
    return run_driver(spec, str(tmp_path_factory.mktemp("vllm-qwen3-run")))


def test_random_qwen3_greedy_equals_ours_and_transformers(qwen3, qwen3_dir):
    recs = qwen3["jobs"][0]["out"]
    prompt_ids = [r["prompt_token_ids"] for r in recs]
    mine, _ = ours(
        qwen3_dir,
        [{"prompt_token_ids": p} for p in prompt_ids],
        64,
        max_model_len=128,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_gpu_blocks=12,
        block_size=16,
    )
    hf = hf_model(qwen3_dir)
    for r, p, m in zip(recs, prompt_ids, mine):
        assert r["token_ids"] == m
        assert r["token_ids"] == hf_greedy(hf, p, 64)
        assert r["finish_reason"] == "length"
    assert qwen3["jobs"][1]["out"]["vllm:num_preemptions"] > 0

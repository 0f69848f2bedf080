"""EAGLE-3 and MTP speculation in the engine, with random-weight heads on a tiny random Llama.

The oracle is the engine without speculation: greedy output must be token-for-token equal. Random
heads are almost never right, so two wrappers around the head force the other paths while it
still runs (its K/V writes, catch-up after every step): one swaps its drafts for the right
continuation (every draft accepted), one for wrong tokens (rejected at position 0).
"""

from __future__ import annotations

import numpy as np
import pytest
from draft_checkpoints import with_mtp_layer, write_eagle3  # tests/draft_checkpoints.py
from spec_checks import check_preemption_then_abort  # tests/spec_checks.py

from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(900)

K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
BASE = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks=80)


def _prompts():
    rng = np.random.default_rng(5)
    return [{"prompt_token_ids": [int(t) for t in rng.integers(100, 3000, n)]} for n in (7, 19, 30, 12, 44)]


@pytest.fixture(scope="module")
def heads(random_checkpoints, tmp_path_factory):
    """method -> (target path, speculative config) for the 2-layer Llama."""
    root = tmp_path_factory.mktemp("heads")
    target = random_checkpoints["llama"]
    eagle = write_eagle3(target, str(root / "eagle3"), draft_vocab=5000, aux_layer_ids=(1, 0, 1), seed=4)
    mtp = with_mtp_layer(target, str(root / "mtp"), seed=5, own_head=False)
    return {
        "eagle3": (target, {"method": "eagle3", "model": eagle, "num_speculative_tokens": K}),
        "mtp": (mtp, {"method": "mtp", "num_speculative_tokens": K}),
    }


@pytest.fixture(scope="module")
def reference(random_checkpoints):
    llm = LLM(random_checkpoints["llama"], **BASE, warmup=False)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=["eagle3", "mtp"])
def spec_llm(request, heads):
    path, spec = heads[request.param]
    return LLM(path, speculative_config=spec, **BASE, warmup=False)


def _tokens(llm, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


def _swap_drafts(engine, monkeypatch, pick):
    """Run the head as usual, then replace each sequence's drafts with pick(tokens so far, k)."""
    coordinator = engine.spec_decode
    run_head = coordinator.drafts

    def swapped(scheduled):
        out = run_head(scheduled)
        for i, (seq, k) in enumerate(scheduled):
            if k:
                out[i] = [int(t) for t in pick(seq.prompt_token_ids + seq.output_token_ids, k)]
                assert len(out[i]) == k
        return out

    monkeypatch.setattr(coordinator, "drafts", swapped)


def test_greedy_output_is_identical_in_a_mixed_batch(spec_llm, random_checkpoints):
    e = spec_llm.engine
    assert e.draft_runner is not None
    params = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, n=2, ignore_eos=True),
        GREEDY,
    ]
    want = LLM(random_checkpoints["llama"], **BASE, warmup=False).generate(_prompts(), params, use_tqdm=False)
    d0 = e.stats.spec_num_draft_tokens
    got = spec_llm.generate(_prompts(), params, use_tqdm=False)
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    assert e.stats.spec_num_draft_tokens > d0
    assert e.pool.num_free == e.pool.num_usable


def test_right_drafts_are_all_accepted(spec_llm, reference, monkeypatch):
    e = spec_llm.engine
    full = [p["prompt_token_ids"] + r for p, r in zip(_prompts(), reference)]

    def right(tokens, k):
        cont = next(f for f in full if f[: len(tokens)] == tokens)
        return cont[len(tokens) : len(tokens) + k]

    _swap_drafts(e, monkeypatch, right)
    st = e.stats
    d0, a0, s0 = st.spec_num_draft_tokens, st.spec_num_accepted_tokens, st.steps
    assert _tokens(spec_llm) == reference
    assert st.spec_num_draft_tokens > d0
    assert st.spec_num_accepted_tokens - a0 == st.spec_num_draft_tokens - d0
    assert st.steps - s0 < 20 // 2  # 1 + K tokens a step


def test_wrong_drafts_are_rejected_at_position_zero(spec_llm, reference, monkeypatch):
    e = spec_llm.engine
    full = [p["prompt_token_ids"] + r for p, r in zip(_prompts(), reference)]
    vocab = e.arch.vocab_size

    def wrong(tokens, k):
        nxt = next(f for f in full if f[: len(tokens)] == tokens)[len(tokens)]
        return [(nxt + 1 + j) % vocab for j in range(k)]

    _swap_drafts(e, monkeypatch, wrong)
    a0, d0 = e.stats.spec_num_accepted_tokens, e.stats.spec_num_draft_tokens
    assert _tokens(spec_llm) == reference
    assert e.stats.spec_num_accepted_tokens == a0 and e.stats.spec_num_draft_tokens > d0


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_preemption_and_abort(heads, reference, method):
    path, spec = heads[method]
    small = LLM(
        path,
        speculative_config=spec,
        **{**BASE, "num_gpu_blocks": 9, "max_num_seqs": 5, "max_model_len": 128},
        warmup=False,
    )
    assert _tokens(small) == reference
    check_preemption_then_abort(small.engine, _prompts()[0]["prompt_token_ids"])


def test_steady_state_compiles_nothing_new(heads):
    path, spec = heads["mtp"]
    llm = LLM(path, speculative_config=spec, warmup=True, **BASE)
    e = llm.engine

    def count():
        return e.runner.compile_count + e.draft_runner.compile_count

    before = count()
    _tokens(llm)
    _tokens(llm, SamplingParams(temperature=0.7, max_tokens=20, seed=3, ignore_eos=True))
    assert count() == before

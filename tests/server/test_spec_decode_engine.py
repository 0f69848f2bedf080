"""Speculative decoding in the engine, on a tiny random-weight Llama with the real tokenizer.

The oracle is the same engine without speculation: greedy outputs must be token-for-token equal
whatever the drafter proposes: n-gram drafts, a drafter replaying the right continuation (every
draft accepted: bonus tokens, multi-token K/V writes) and an adversarial one (every first draft
rejected: rollback over stale K/V).
"""

from __future__ import annotations

import numpy as np
import pytest
from spec_checks import check_preemption_then_abort  # tests/spec_checks.py

from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _llm(path, spec=None, **kw):
    base = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks=80, warmup=False)
    base.update(kw)
    return LLM(path, speculative_config=spec, **base)


def _prompts():
    """Repetitive token prompts (n-gram hits), and a plain one."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(5):
        motif = [int(t) for t in rng.integers(100, 3000, 6 + i)]
        out.append({"prompt_token_ids": motif * 4 + motif[:3]})
    out.append({"prompt_token_ids": [int(t) for t in rng.integers(100, 3000, 30)]})
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(random_checkpoints):
    llm = _llm(random_checkpoints["llama"])
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def spec_llm(random_checkpoints):
    return _llm(random_checkpoints["llama"], NGRAM)


def _tokens(llm, prompts=None, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts or _prompts(), params, use_tqdm=False)]


def test_ngram_greedy_output_is_identical(spec_llm, reference):
    e = spec_llm.engine
    e.drafter = e._ngram_drafter
    before = e.stats.spec_num_draft_tokens
    assert _tokens(spec_llm) == reference
    st = e.stats
    assert st.spec_num_draft_tokens > before and st.spec_num_accepted_tokens > 0
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
    assert st.spec_accepted_per_pos[0] >= st.spec_accepted_per_pos[-1]
    assert e.pool.num_free == e.pool.num_usable


def test_replayed_continuation_is_fully_accepted(spec_llm, reference):
    e = spec_llm.engine
    prompts = _prompts()
    full = {tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + ref for p, ref in zip(prompts, reference)}

    def replay(tokens, k):
        for key, cont in full.items():
            n = len(key)
            if tuple(tokens[:n]) == key and list(tokens) == cont[: len(tokens)]:
                return cont[len(tokens) : len(tokens) + k]
        raise AssertionError("unknown sequence")

    e.drafter = replay
    st = e.stats
    d0, a0, s0 = st.spec_num_draft_tokens, st.spec_num_accepted_tokens, st.steps
    try:
        assert _tokens(spec_llm) == reference
    finally:
        e.drafter = e._ngram_drafter
    assert st.spec_num_draft_tokens - d0 > 0
    assert st.spec_num_accepted_tokens - a0 == st.spec_num_draft_tokens - d0  # all accepted
    # 24 tokens each in far fewer steps than 24 decode steps.
    assert st.steps - s0 < 24


def test_wrong_drafts_are_rejected_at_position_zero(spec_llm, reference):
    e = spec_llm.engine
    vocab = e.arch.vocab_size
    ref_of = {len(p["prompt_token_ids"]): (p["prompt_token_ids"], r) for p, r in zip(_prompts(), reference)}

    def adversarial(tokens, k):
        # The right next token plus one: never what greedy decoding picks.
        for prompt, ref in ref_of.values():
            if list(tokens[: len(prompt)]) == prompt:
                nxt = ref[len(tokens) - len(prompt)]
                return [(nxt + 1 + j) % vocab for j in range(k)]
        raise AssertionError("unknown sequence")

    e.drafter = adversarial
    a0, d0 = e.stats.spec_num_accepted_tokens, e.stats.spec_num_draft_tokens
    try:
        assert _tokens(spec_llm) == reference
    finally:
        e.drafter = e._ngram_drafter
    assert e.stats.spec_num_accepted_tokens == a0 and e.stats.spec_num_draft_tokens > d0


def test_mixed_batch_with_non_drafting_requests(spec_llm, random_checkpoints):
    """Logprobs, penalties and stop strings ride in the same batches as drafting sequences."""
    prompts = _prompts()
    params = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, n=2, ignore_eos=True),
        GREEDY,
    ]
    plain = _llm(random_checkpoints["llama"])
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
    # The chosen tokens' logprobs agree (batch shapes differ, so near-tied runners-up may swap).
    c_w, c_g = want[1].outputs[0], got[1].outputs[0]
    chosen = [(lp[t].logprob, lq[t].logprob) for t, lp, lq in zip(c_w.token_ids, c_w.logprobs, c_g.logprobs)]
    assert len(chosen) == 10 and all(abs(a - b) < 1e-3 for a, b in chosen)


def test_preemption_and_abort_during_speculation(random_checkpoints, reference):
    small = _llm(random_checkpoints["llama"], NGRAM, num_gpu_blocks=9, max_num_seqs=6, max_model_len=128)
    assert _tokens(small) == reference
    check_preemption_then_abort(small.engine, _prompts()[0]["prompt_token_ids"])


def test_random_sampling_with_drafts_runs_and_is_seeded(spec_llm):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seed=11, ignore_eos=True)
    a = _tokens(spec_llm, params=params)
    b = _tokens(spec_llm, params=params)
    assert a == b and all(len(t) == 20 for t in a)


def test_steady_state_compiles_nothing_new(random_checkpoints):
    llm = _llm(random_checkpoints["llama"], NGRAM, warmup=True)
    runner = llm.engine.runner
    before = runner.compile_count
    _tokens(llm)
    _tokens(llm, params=SamplingParams(temperature=0.7, max_tokens=20, seed=3, ignore_eos=True))
    assert runner.compile_count == before


def test_drafts_under_a_grammar(spec_llm, random_checkpoints):
    """Grammar requests draft too: each verification row carries the grammar's mask after the
    drafts before it. Greedy output equals the plain engine's with n-gram, replayed (accepted) and
    grammar-violating (rejected) drafts."""
    from tpuserve.server.sampling_params import StructuredOutputParams

    so = StructuredOutputParams(regex="(red|green|blue)(, (red|green|blue)){8,40}\\.")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, structured_outputs=so)
    prompts = _prompts()[:4]
    want = [
        o.outputs[0].token_ids
        for o in _llm(random_checkpoints["llama"]).generate(prompts, params, use_tqdm=False)
    ]
    e = spec_llm.engine
    full = [p["prompt_token_ids"] + w for p, w in zip(prompts, want)]

    def replay(tokens, k):
        cont = next(f for f in full if f[: len(tokens)] == list(tokens))
        return cont[len(tokens) : len(tokens) + k]

    def violating(tokens, k):  # the right token's neighbours: outside the grammar or wrong
        cont = next(f for f in full if f[: len(tokens)] == list(tokens))
        return [cont[len(tokens)] + 1] * k

    st = e.stats
    for drafter, all_accepted in ((e._ngram_drafter, False), (replay, True), (violating, False)):
        e.drafter = drafter
        d0, a0 = st.spec_num_draft_tokens, st.spec_num_accepted_tokens
        try:
            got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)]
        finally:
            e.drafter = e._ngram_drafter
        assert got == want, drafter
        assert st.spec_num_draft_tokens > d0
        if all_accepted:
            assert st.spec_num_accepted_tokens - a0 == st.spec_num_draft_tokens - d0
        if drafter is violating:
            assert st.spec_num_accepted_tokens == a0
    assert e.pool.num_free == e.pool.num_usable

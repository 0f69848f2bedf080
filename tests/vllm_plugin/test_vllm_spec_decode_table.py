"""Speculative decoding in the worker's request table and drafter (no vLLM, no JAX).

vLLM's contract (spec_decode.py): drafts arrive in ``scheduled_spec_decode_tokens`` and count among
the scheduled tokens; the worker answers with the accepted drafts plus one token, and may verify
only a prefix (``-1`` padding, a request under a token mask): the rest counts as rejected.
The scheduler stand-ins come from test_vllm_request_state.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_vllm_request_state import BS, cached, new_req, sched

from tpuserve.tpu_platform.step_batch import Logprobs, StepOutput
from tpuserve.tpu_platform.vllm_plugin.request_state import RequestTable
from tpuserve.tpu_platform.vllm_plugin.spec_decode import DraftPlanner, NgramSettings, unsupported_speculative

pytestmark = pytest.mark.timeout(60)


def spec_sched(entries, drafts, **kw):
    """entries: (req_id, new_blocks, num_computed, num_scheduled incl. drafts)."""
    so = sched(cached_reqs=cached([e[:3] for e in entries]), num={e[0]: e[3] for e in entries}, **kw)
    so.scheduled_spec_decode_tokens = drafts
    return so


def out(rows, accepted, logprobs=None):
    """rows: each sequence's [K+1] new-token slots (-1 pads)."""
    width = max(len(r) for r in rows)
    ids = np.array([list(r) + [-1] * (width - len(r)) for r in rows], np.int32)
    return StepOutput(token_ids=ids, num_accepted=np.asarray(accepted, np.int32), logprobs=logprobs)


def prefill(t, rid, prompt, blocks, first, **sp):
    plan = t.plan(sched(new=[new_req(rid, prompt, blocks, **sp)], num={rid: len(prompt)}))
    plan.finish(t, out([[first]], [0]))


def test_drafts_are_verified_after_the_last_token_and_accepted_ones_kept():
    t = RequestTable(BS, vocab_size=100)
    prefill(t, "a", [1, 2, 3], [1, 2], 4)
    # vLLM scheduled token 4 (known only to the worker) and three drafts: 4 tokens in all.
    plan = t.plan(spec_sched([("a", None, 3, 4)], {"a": [5, 6, 7]}))
    seq = plan.scheduled(t)[0]
    assert seq.token_ids == [4] and seq.draft_token_ids == [5, 6, 7] and seq.num_computed == 3
    assert seq.page_ids == [1, 2]  # covers 3 + 1 + 3 tokens
    res = plan.finish(t, out([[5, 6, 9, -1]], [2]))  # drafts 5, 6 accepted, 9 sampled after them
    assert res.sampled_token_ids == [[5, 6, 9]]
    assert t.requests["a"].token_ids == [1, 2, 3, 4, 5, 6, 9]
    # vLLM rolls back the rejected draft: computed = 3 + 4 - 1 = 6; token 9 is next.
    plan = t.plan(spec_sched([("a", None, 6, 1)], {}))
    assert plan.scheduled(t)[0].token_ids == [9]


def test_padding_and_masked_requests_verify_nothing():
    t = RequestTable(BS, vocab_size=100)
    prefill(t, "a", [1, 2, 3], [1, 2], 4)
    prefill(t, "g", [1, 2, 3], [3, 4], 4, structured_outputs=object())
    # -1 is vLLM's padding (a new decode padded to 1 + K rows); the grammar request's drafts
    # cannot be verified under its mask. Both then sample one token: everything else is rejected.
    plan = t.plan(spec_sched([("a", None, 3, 4), ("g", None, 3, 3)], {"a": [8, -1, -1], "g": [5, 6]}))
    seqs = plan.scheduled(t)
    assert [s.draft_token_ids for s in seqs] == [[8], []]
    assert [s.token_ids for s in seqs] == [[4], [4]]
    assert plan.scheduled_drafts == {"a": 3, "g": 2}  # the grammar bitmask's rows follow these
    res = plan.finish(t, out([[8, 9], [7]], [1, 0]))
    assert res.sampled_token_ids == [[8, 9], [7]]


def test_logprob_rows_follow_each_requests_positions():
    t = RequestTable(BS, vocab_size=100)
    prefill(t, "a", [1, 2, 3], [1, 2], 4, logprobs=1)
    prefill(t, "b", [1, 2, 3], [3, 4], 4, logprobs=1)
    plan = t.plan(spec_sched([("a", None, 3, 3), ("b", None, 3, 1)], {"a": [5, 6]}))
    # Logits rows: a's three positions, then b's one.
    lp = Logprobs(
        token_logprobs=np.array([-0.1, -0.2, -0.3, -0.4, 0], np.float32),
        token_ranks=np.array([1, 1, 2, 1, 0], np.int32),
        top_ids=np.array([[5], [6], [8], [11], [0]], np.int32),
        top_logprobs=np.array([[-0.1], [-0.2], [-0.01], [-0.4], [0]], np.float32),
    )
    res = plan.finish(t, out([[5, 7, -1], [11]], [1, 0], logprobs=lp))
    assert res.sampled_token_ids == [[5, 7], [11]]
    assert res.cu_num_generated_tokens == [0, 3, 4]
    # vLLM reads rows cu[i] .. cu[i] + len(sampled): a's are rows 0-1 (tokens 5, 7), b's row 3.
    np.testing.assert_array_equal(res.logprob_token_ids[[0, 1, 3]], [[5, 5], [7, 6], [11, 11]])
    np.testing.assert_allclose(res.logprobs[[0, 1, 3], 0], [-0.1, -0.2, -0.4])


def test_drafter_proposes_for_sampled_requests_it_can_verify():
    t = RequestTable(BS, vocab_size=100)
    motif = [10, 11, 12, 13]
    prefill(t, "a", motif * 3, [1, 2, 3, 4], 10)
    prefill(t, "m", motif * 3, [5, 6, 7, 8], 10, min_tokens=5)
    prefill(t, "g", motif * 3, [9, 10, 11, 12], 10, structured_outputs=object())
    d = DraftPlanner(NgramSettings(3, 2, 4), max_model_len=64).propose(t, ["a", "m", "g"])
    assert d.req_ids == ["a", "m", "g"]
    # The suffix "11 12 13 10" first occurs at 1..4, followed by 11 12 13; the others do not draft yet.
    assert d.draft_token_ids == [[11, 12, 13], [], []]


def test_drafter_proposes_for_logprob_and_penalty_requests():
    """The worker returns logprob rows per verified position and the runner counts drafts into
    the penalties, so under the shared rule these draft here (the engine keeps them plain)."""
    t = RequestTable(BS, vocab_size=100)
    motif = [10, 11, 12, 13]
    prefill(t, "l", motif * 3, [1, 2, 3, 4], 10, logprobs=2)
    prefill(t, "p", motif * 3, [5, 6, 7, 8], 10, repetition_penalty=1.2, frequency_penalty=0.5)
    prefill(t, "x", motif * 3, [9, 10, 11, 12], 10, allowed_token_ids=[10, 11, 12, 13])
    d = DraftPlanner(NgramSettings(3, 2, 4), max_model_len=64).propose(t, ["l", "p", "x"])
    assert d.draft_token_ids == [[11, 12, 13], [11, 12, 13], []]


def test_only_ngram_is_accepted():
    def sc(**kw):
        base = dict(
            method="ngram",
            num_speculative_tokens=3,
            num_speculative_tokens_per_batch_size=None,
            rejection_sample_method="standard",
            parallel_drafting=False,
        )
        base.update(kw)
        return SimpleNamespace(**base)

    assert unsupported_speculative(None) == [] and unsupported_speculative(sc()) == []
    for method in ("eagle3", "mtp", "draft_model", "suffix"):
        (msg,) = unsupported_speculative(sc(method=method))
        assert "--speculative-config" in msg and repr(method) in msg and "'ngram' only" in msg
    assert "num_speculative_tokens=17" in unsupported_speculative(sc(num_speculative_tokens=17))[0]
    assert "rejection_sample_method" in unsupported_speculative(sc(rejection_sample_method="synthetic"))[0]

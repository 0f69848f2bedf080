"""The worker's request table: vLLM scheduler deltas -> our ScheduledSeq chunks, and back.

Pure Python + numpy (no vLLM, no JAX): vLLM's scheduler objects are stand-ins with the same
attribute names, so this runs in the main test venv too. test_vllm_platform.py feeds the real
vLLM dataclasses through the same code in the vLLM venv.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tpuserve.tpu_platform.step_batch import Logprobs, StepOutput
from tpuserve.tpu_platform.vllm_plugin.request_state import RequestTable
from tpuserve.tpu_platform.vllm_plugin.sampling import SamplingSpec, UnsupportedRequest, allowed_ids_bitmask

pytestmark = pytest.mark.timeout(60)

BS = 4  # block size


def params(**kw):
    base = dict(
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=None,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_tokens=0,
        all_stop_token_ids={2},
        logprobs=None,
        prompt_logprobs=None,
        allowed_token_ids=None,
        logit_bias=None,
        bad_words=None,
        logprob_token_ids=None,
        prompt_logprob_start=None,
        thinking_token_budget=None,
        watermarking=None,
        trace_decode_token_ids=None,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def new_req(rid, prompt, blocks, computed=0, **sp):
    return SimpleNamespace(
        req_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=params(**sp),
        pooling_params=None,
        lora_request=None,
        block_ids=(list(blocks),),
        num_computed_tokens=computed,
        prefill_token_ids=None,
    )


def cached(entries=(), resumed=(), all_tokens=None):
    """entries: (req_id, new_blocks or None, num_computed)."""
    return SimpleNamespace(
        req_ids=[e[0] for e in entries],
        resumed_req_ids=set(resumed),
        new_token_ids=[],
        all_token_ids=dict(all_tokens or {}),
        new_block_ids=[None if e[1] is None else (list(e[1]),) for e in entries],
        num_computed_tokens=[e[2] for e in entries],
        num_output_tokens=[0] * len(entries),
    )


def sched(new=(), cached_reqs=None, num=None, finished=(), preempted=None):
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached_reqs or cached(),
        num_scheduled_tokens=dict(num or {}),
        scheduled_spec_decode_tokens={},
        finished_req_ids=set(finished),
        preempted_req_ids=preempted,
    )


def step_out(tokens, logprobs=None, prompt_logprobs=None):
    ids = np.asarray(tokens, np.int32)[:, None]
    return StepOutput(
        token_ids=ids,
        num_accepted=np.zeros(len(ids), np.int32),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def run(table, so, tokens, **kw):
    plan = table.plan(so)
    seqs = plan.scheduled(table)
    return plan, seqs, plan.finish(table, step_out(tokens, **kw))


def test_prefill_then_decode_only_deltas():
    t = RequestTable(BS, vocab_size=100)
    plan, seqs, res = run(t, sched(new=[new_req("a", [5, 6, 7], [1])], num={"a": 3}), [42])
    assert [s.token_ids for s in seqs] == [[5, 6, 7]]
    assert seqs[0].num_computed == 0 and seqs[0].page_ids == [1]
    assert res.req_ids == ["a"] and res.sampled_token_ids == [[42]]
    # Decode: the scheduler sends no tokens, only the computed count; the worker supplies 42 itself.
    plan, seqs, res = run(t, sched(cached_reqs=cached([("a", None, 3)]), num={"a": 1}), [43])
    assert seqs[0].token_ids == [42] and seqs[0].num_computed == 3 and seqs[0].page_ids == [1]
    # Crossing into a new block: its id arrives as a delta and is appended.
    plan, seqs, res = run(t, sched(cached_reqs=cached([("a", [9], 4)]), num={"a": 1}), [44])
    assert seqs[0].token_ids == [43] and seqs[0].page_ids == [1, 9]
    assert t.requests["a"].token_ids == [5, 6, 7, 42, 43, 44]
    # Finished requests are dropped.
    t.plan(sched(finished=["a"]))
    assert len(t) == 0


def test_chunked_prefill_drops_mid_prompt_samples():
    t = RequestTable(BS, vocab_size=100)
    prompt = list(range(10, 20))
    _, seqs, res = run(t, sched(new=[new_req("a", prompt, [1, 2, 3])], num={"a": 6}), [99])
    assert seqs[0].token_ids == prompt[:6] and seqs[0].page_ids == [1, 2]
    assert res.sampled_token_ids == [[]]  # the prompt goes on: nothing sampled yet
    _, seqs, res = run(t, sched(cached_reqs=cached([("a", None, 6)]), num={"a": 4}), [77])
    assert seqs[0].token_ids == prompt[6:] and seqs[0].num_computed == 6
    assert seqs[0].page_ids == [1, 2, 3]
    assert res.sampled_token_ids == [[77]]


def test_prefix_cache_hit_starts_late():
    t = RequestTable(BS, vocab_size=100)
    prompt = list(range(30, 39))  # 9 tokens; the scheduler found 8 cached (2 full blocks)
    _, seqs, res = run(t, sched(new=[new_req("b", prompt, [4, 5, 6], computed=8)], num={"b": 1}), [1])
    assert seqs[0].token_ids == [38] and seqs[0].num_computed == 8 and seqs[0].page_ids == [4, 5, 6]
    assert res.sampled_token_ids == [[1]]


def test_preempted_request_resumes_with_new_blocks_and_recomputes():
    t = RequestTable(BS, vocab_size=100)
    run(t, sched(new=[new_req("a", [1, 2, 3], [1])], num={"a": 3}), [4])
    run(t, sched(cached_reqs=cached([("a", None, 3)]), num={"a": 1}), [5])
    # Preempted (pages freed), then resumed: fresh blocks replace the old ones, and V1 sends the
    # scheduler's full token list because the request was not scheduled in the previous step.
    so = sched(
        cached_reqs=cached([("a", [7, 8], 0)], resumed=["a"], all_tokens={"a": [1, 2, 3, 4, 5]}), num={"a": 5}
    )
    _, seqs, res = run(t, so, [6])
    assert seqs[0].token_ids == [1, 2, 3, 4, 5] and seqs[0].num_computed == 0
    assert seqs[0].page_ids == [7, 8]
    assert res.sampled_token_ids == [[6]]
    assert t.requests["a"].output_ids == [4, 5, 6]


def test_preemption_keeps_state_until_resent_as_new():
    t = RequestTable(BS, vocab_size=100)
    run(t, sched(new=[new_req("a", [1, 2, 3], [1])], num={"a": 3}), [4])
    t.plan(sched(preempted={"a"}))  # vLLM lists it; V1 resumes it later as a cached request
    assert t.requests["a"].token_ids == [1, 2, 3, 4]
    # Model runner V2 instead re-sends it as new, with prompt + outputs as prefill tokens.
    again = new_req("a", [1, 2, 3], [5, 6])
    again.prefill_token_ids = [1, 2, 3, 4]
    _, seqs, res = run(t, sched(new=[again], num={"a": 4}), [9])
    assert seqs[0].token_ids == [1, 2, 3, 4] and seqs[0].page_ids == [5]
    assert t.requests["a"].output_ids == [4, 9]


def test_batch_order_and_logprob_columns():
    t = RequestTable(BS, vocab_size=100)
    so = sched(
        new=[new_req("a", [1, 2], [1], logprobs=2), new_req("b", [3, 4, 5], [2])], num={"a": 2, "b": 3}
    )
    lp = Logprobs(
        token_logprobs=np.array([-0.1, -0.2], np.float32),
        token_ranks=np.array([1, 2], np.int32),
        top_ids=np.array([[7, 8], [9, 10]], np.int32),
        top_logprobs=np.array([[-0.1, -1.0], [-0.05, -0.2]], np.float32),
    )
    _, seqs, res = run(t, so, [7, 10], logprobs=lp)
    assert seqs[0].sampling.num_logprobs == 2 and seqs[1].sampling.num_logprobs is None
    assert res.req_ids == ["a", "b"] and res.sampled_token_ids == [[7], [10]]
    np.testing.assert_array_equal(res.logprob_token_ids, [[7, 7, 8], [10, 9, 10]])
    np.testing.assert_allclose(res.logprobs, [[-0.1, -0.1, -1.0], [-0.2, -0.05, -0.2]])
    np.testing.assert_array_equal(res.sampled_ranks, [1, 2])


def test_prompt_logprobs_accumulate_over_chunks():
    t = RequestTable(BS, vocab_size=100)
    prompt = [11, 12, 13, 14, 15]
    so = sched(new=[new_req("a", prompt, [1, 2], prompt_logprobs=1)], num={"a": 3})
    plan = t.plan(so)
    seqs = plan.scheduled(t)
    # Rows 0..2 of the chunk want the logprobs of prompt tokens 1..3.
    assert seqs[0].prompt_logprob_targets == [12, 13, 14] and seqs[0].num_prompt_logprobs == 1
    pl = Logprobs(
        token_logprobs=np.array([-1, -2, -3], np.float32),
        token_ranks=np.array([3, 1, 2], np.int32),
        top_ids=np.array([[50], [13], [60]], np.int32),
        top_logprobs=np.array([[-0.5], [-2], [-1]], np.float32),
    )
    res = plan.finish(t, step_out([0], prompt_logprobs=pl))
    assert res.prompt_logprobs == {} and res.sampled_token_ids == [[]]
    plan = t.plan(sched(cached_reqs=cached([("a", None, 3)]), num={"a": 2}))
    seqs = plan.scheduled(t)
    assert seqs[0].prompt_logprob_targets == [15]  # the last prompt token has no successor in the prompt
    pl2 = Logprobs(
        token_logprobs=np.array([-4], np.float32),
        token_ranks=np.array([5], np.int32),
        top_ids=np.array([[70]], np.int32),
        top_logprobs=np.array([[-0.1]], np.float32),
    )
    res = plan.finish(t, step_out([21], prompt_logprobs=pl2))
    buf = res.prompt_logprobs["a"]
    np.testing.assert_array_equal(buf.token_ids, [[12, 50], [13, 13], [14, 60], [15, 70]])
    np.testing.assert_allclose(buf.logprobs[:, 0], [-1, -2, -3, -4])
    np.testing.assert_array_equal(buf.ranks, [3, 1, 2, 5])
    assert res.sampled_token_ids == [[21]]
    assert t.requests["a"].prompt_logprobs is None  # delivered exactly once


def test_min_tokens_bans_stop_ids_and_seeds():
    t = RequestTable(BS, vocab_size=100, seed=3)
    so = sched(
        new=[
            new_req("a", [1, 2], [1], min_tokens=2, temperature=0.7, seed=1234),
            new_req("b", [1, 2], [2], temperature=1.0),
        ],
        num={"a": 2, "b": 2},
    )
    plan = t.plan(so)
    rows = [s.sampling for s in plan.scheduled(t)]
    assert rows[0].banned_ids == [2] and rows[0].seed == 1234 and rows[0].step == 0
    assert rows[1].banned_ids is None and rows[1].seed != 0  # an unseeded request gets a drawn seed
    plan.finish(t, step_out([5, 6]))
    plan = t.plan(sched(cached_reqs=cached([("a", None, 2)]), num={"a": 1}))
    row = plan.scheduled(t)[0].sampling
    assert row.banned_ids == [2] and row.step == 1
    plan.finish(t, step_out([7]))
    plan = t.plan(sched(cached_reqs=cached([("a", None, 3)]), num={"a": 1}))
    assert plan.scheduled(t)[0].sampling.banned_ids is None  # two tokens out: EOS allowed again


def test_grammar_and_allowed_ids_masks_combine():
    t = RequestTable(BS, vocab_size=64)
    so = sched(new=[new_req("a", [1], [1], allowed_token_ids=[3, 40])], num={"a": 1})
    plan = t.plan(so)
    grammar = allowed_ids_bitmask([3, 5], 64)
    row = plan.scheduled(t, {"a": grammar})[0].sampling
    np.testing.assert_array_equal(row.token_bitmask, allowed_ids_bitmask([3], 64))


def test_unsupported_sampling_features_are_refused():
    with pytest.raises(UnsupportedRequest, match="logit_bias"):
        SamplingSpec.from_vllm(params(logit_bias={1: 2.0}), 100, 0)
    spec = SamplingSpec.from_vllm(params(top_k=-1, logprobs=-1), 100, 0)
    assert spec.top_k == 0 and spec.num_logprobs == 100  # vLLM's -1 conventions


def test_scheduler_and_worker_disagreeing_is_loud():
    t = RequestTable(BS, vocab_size=100)
    with pytest.raises(RuntimeError, match="blocks cannot hold"):
        t.plan(sched(new=[new_req("a", list(range(9)), [1, 2])], num={"a": 9}))

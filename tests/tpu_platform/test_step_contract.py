"""The StepBatch / StepOutput contract: build_batch's padding, multi-token steps with greedy draft
verification and KV rollback, and device-side token feeds (async scheduling).

The oracle for every multi-token and fed step is the plain one-token-per-step greedy decode of the
same runner, which the parity tests tie to transformers.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.kv_cache.layout import RESERVED_PAGE
from tpuserve.tpu_platform.config import EngineConfig
from tpuserve.tpu_platform.device import discover
from tpuserve.tpu_platform.loader import load_model
from tpuserve.tpu_platform.model_runner import ModelRunner
from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

pytestmark = pytest.mark.timeout(600)

PAGE = 16


@pytest.fixture(scope="module")
def runner(random_checkpoints):
    path = random_checkpoints["llama"]
    loaded = load_model(path, jnp.float32)
    config = EngineConfig.from_kwargs(model=path, max_num_batched_tokens=32, max_num_seqs=4,
                                      block_size=PAGE)
    return ModelRunner(config, loaded.arch, loaded.params, discover(), jnp.float32, num_pages=64,
                       max_model_len=256)


def _seq(tokens, computed, pages, **kw):
    return ScheduledSeq(token_ids=list(tokens), num_computed=computed, page_ids=list(pages),
                        sampling=SamplingRow(), **kw)


def test_build_batch_padding_contract(runner):
    seqs = [_seq([5, 6, 7], 0, [3]), _seq([9], 20, [4, 5])]
    b = runner.build_batch(seqs)
    assert b.token_ids.shape == (4,) and b.num_tokens == 4 and b.num_seqs == 2  # T bucket 4
    assert b.kv_lens.shape == (4,)  # S = min(T, max_num_seqs)
    np.testing.assert_array_equal(b.token_ids, [5, 6, 7, 9])
    np.testing.assert_array_equal(b.positions, [0, 1, 2, 20])
    np.testing.assert_array_equal(b.cu_q_lens, [0, 3, 4, 4, 4])  # padding slots repeat the total
    np.testing.assert_array_equal(b.kv_lens, [3, 21, 0, 0])
    assert b.page_table.shape[1] in runner.page_buckets
    np.testing.assert_array_equal(b.page_table[0, :2], [3, RESERVED_PAGE])
    np.testing.assert_array_equal(b.page_table[1, :3], [4, 5, RESERVED_PAGE])
    assert (b.page_table[2:] == RESERVED_PAGE).all()
    np.testing.assert_array_equal(b.logits_indices, [2, 3, 0, 0])  # each sequence's last token
    np.testing.assert_array_equal(b.cu_logits, [0, 1, 2, 2, 2])
    assert b.draft_token_ids.shape == (4, 0) and b.feed_rows is None
    np.testing.assert_array_equal(b.num_drafts, [0, 0, 0, 0])
    assert b.sampling.temperature.shape == (4,)


def test_build_batch_with_drafts_and_feeds(runner):
    seqs = [_seq([5, 6], 0, [3], draft_token_ids=[8, 9, 10]), _seq([0], 7, [4], feed_from=2)]
    b = runner.build_batch(seqs)
    np.testing.assert_array_equal(b.token_ids[:6], [5, 6, 8, 9, 10, 0])
    np.testing.assert_array_equal(b.positions[:6], [0, 1, 2, 3, 4, 7])
    np.testing.assert_array_equal(b.kv_lens[:2], [5, 8])
    # Rows of the last known token and of every draft: 4 for the first sequence, 1 for the second.
    np.testing.assert_array_equal(b.cu_logits[:3], [0, 4, 5])
    np.testing.assert_array_equal(b.logits_indices[:5], [1, 2, 3, 4, 5])
    assert len(b.logits_indices) in runner.token_buckets
    np.testing.assert_array_equal(b.draft_token_ids[:2], [[8, 9, 10, -1], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(b.num_drafts[:2], [3, 0])
    np.testing.assert_array_equal(b.feed_rows[:6], [-1, -1, -1, -1, -1, 2])


@pytest.mark.parametrize("seqs, match", [
    ([], "at least one sequence"),
    ([_seq([], 0, [1])], "at least one token"),
    ([_seq([1] * 20, 0, [1])], "cannot hold"),
    ([_seq([1], 0, [1])] * 5, "exceed"),
])
def test_build_batch_refuses_bad_work(runner, seqs, match):
    with pytest.raises(ValueError, match=match):
        runner.build_batch(seqs)


def test_drafts_refused_for_random_rows(runner):
    s = ScheduledSeq([1], 0, [1], SamplingRow(temperature=0.7), draft_token_ids=[2])
    with pytest.raises(ValueError, match="greedy-only"):
        runner.build_batch([s])


def _greedy_reference(runner, prompt, pages, n):
    """n greedy tokens, one step each."""
    out = runner.execute(runner.build_batch([_seq(prompt, 0, pages)]))
    tokens = [int(out.token_ids[0, 0])]
    for _ in range(n - 1):
        done = len(prompt) + len(tokens) - 1
        out = runner.execute(runner.build_batch([_seq([tokens[-1]], done, pages)]))
        tokens.append(int(out.token_ids[0, 0]))
    return tokens


def test_multi_token_steps_verify_drafts_and_roll_back(runner):
    prompt = [11, 23, 5, 42, 17, 8, 99]
    pages = [1, 2]
    ref = _greedy_reference(runner, prompt, pages, 8)

    # Prefill, then the true continuation as drafts: every draft accepted, plus the bonus token.
    out = runner.execute(runner.build_batch([_seq(prompt, 0, pages)]))
    assert out.new_tokens(0) == ref[:1] and int(out.num_accepted[0]) == 0
    out = runner.execute(runner.build_batch([_seq([ref[0]], len(prompt), pages,
                                                   draft_token_ids=ref[1:4])]))
    assert int(out.num_accepted[0]) == 3 and out.new_tokens(0) == ref[:5][1:]
    done = len(prompt) + 4  # prompt + ref[0..3] are in the cache
    # Wrong drafts from the first position: none accepted, the target's own token comes back.
    wrong = [(t + 1) % 1000 for t in ref[5:8]]
    out = runner.execute(runner.build_batch([_seq([ref[4]], done, pages, draft_token_ids=wrong)]))
    assert int(out.num_accepted[0]) == 0 and out.new_tokens(0) == [ref[5]]
    # Rollback: the rejected drafts' K/V past the accepted point are simply overwritten.
    out = runner.execute(runner.build_batch([_seq([ref[5]], done + 1, pages, draft_token_ids=ref[6:8])]))
    assert int(out.num_accepted[0]) == 2 and out.new_tokens(0)[:2] == ref[6:8]


def test_fed_steps_equal_host_steps(runner):
    """Async scheduling's device feed gives the tokens the host loop gives."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    pages = [[3, 4], [5, 6]]
    refs = [_greedy_reference(runner, p, pg, 5) for p, pg in zip(prompts, pages)]
    step = runner.sample(runner.forward(runner.build_batch(
        [_seq(p, 0, pg) for p, pg in zip(prompts, pages)])))
    got = [[], []]
    for j in range(4):
        # Slot i's next input is the token still on the device: fed, never read by the host first.
        seqs = [_seq([0], len(p) + j, pg, feed_from=i) for i, (p, pg) in enumerate(zip(prompts, pages))]
        nxt = runner.sample(runner.forward(runner.build_batch(seqs), step))
        prev = runner.fetch(step)
        for i in range(2):
            got[i].append(int(prev.token_ids[i, 0]))
        step = nxt
    last = runner.fetch(step)
    for i in range(2):
        got[i].append(int(last.token_ids[i, 0]))
        assert got[i] == refs[i]


def test_feed_without_previous_step_is_refused(runner):
    with pytest.raises(ValueError, match="previous step"):
        runner.forward(runner.build_batch([_seq([0], 4, [1], feed_from=0)]))

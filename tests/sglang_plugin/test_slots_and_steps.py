"""Slot-id layout checks and batch splitting: pure numpy, no SGLang needed (runs in any venv)."""

from __future__ import annotations

import numpy as np
import pytest

from tpuserve.tpu_platform.sglang_plugin.executor import plan_steps
from tpuserve.tpu_platform.sglang_plugin.slots import SlotLayoutError, check_new_slots, page_table
from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

pytestmark = pytest.mark.timeout(60)


def _slots(pages, page_size, n):
    """The req_to_token row SGLang's paged allocator writes for a request on ``pages``."""
    pos = np.arange(n)
    return np.asarray(pages)[pos // page_size] * page_size + pos % page_size


def test_page_table_is_sglang_page_ids():
    row = _slots([5, 9, 3], 4, 10)
    assert page_table(row, 4).tolist() == [5, 9, 3]
    assert page_table(_slots([7, 2], 1, 2), 1).tolist() == [7, 2]


def test_new_slots_must_match_out_cache_loc():
    row = _slots([5, 9, 3], 4, 10)
    check_new_slots(row, 6, row[6:10], 4)  # what SGLang writes: passes
    bad = row[6:10].copy()
    bad[1] += 1
    with pytest.raises(SlotLayoutError, match="position 7"):
        check_new_slots(row, 6, bad, 4)


def test_page_zero_is_never_used():
    row = _slots([0, 9], 4, 6)
    with pytest.raises(SlotLayoutError, match="page 0"):
        check_new_slots(row, 4, row[4:6], 4)


def _seq(n, computed=0, pages=None):
    return ScheduledSeq(
        token_ids=list(range(100, 100 + n)),
        num_computed=computed,
        page_ids=pages or list(range(1, 1 + (computed + n + 3) // 4)),
        sampling=SamplingRow(),
    )


def test_plan_keeps_small_batches_whole():
    steps = plan_steps([_seq(5), _seq(1, computed=7)], page_size=4, max_tokens=16, max_seqs=4)
    assert len(steps) == 1 and [p.last for p in steps[0]] == [True, True]


def test_plan_splits_long_chunk_in_order():
    seq = _seq(10, computed=2)
    steps = plan_steps([seq], page_size=4, max_tokens=4, max_seqs=4)
    pieces = [s[0] for s in steps]
    assert [p.seq.num_computed for p in pieces] == [2, 6, 10]
    assert sum((p.seq.token_ids for p in pieces), []) == seq.token_ids
    assert [p.last for p in pieces] == [False, False, True]
    # Each chunk's page table covers exactly the pages its tokens reach.
    assert [len(p.seq.page_ids) for p in pieces] == [2, 3, 3]


def test_plan_respects_seq_slots_and_token_budget():
    seqs = [_seq(1, computed=3) for _ in range(5)] + [_seq(6)]
    steps = plan_steps(seqs, page_size=4, max_tokens=4, max_seqs=2)
    for step in steps:
        assert len(step) <= 2 and sum(len(p.seq.token_ids) for p in step) <= 4
        assert len({p.index for p in step}) == len(step)  # a sequence at most once per step
    done = [p.index for step in steps for p in step if p.last]
    assert sorted(done) == list(range(6))


def test_first_path_of_a_chain_and_of_a_tree():
    from tpuserve.tpu_platform.sglang_plugin.tree import first_path

    chain = np.tril(np.ones((4, 4), bool))  # each node's ancestors, itself included
    assert first_path(chain) == [0, 1, 2, 3]
    # root 0 -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; 3 -> {6}: breadth-first, first child first.
    parent = [-1, 0, 0, 1, 1, 2, 3]
    tree = np.zeros((7, 7), bool)
    for i in range(7):
        j = parent[i]
        while j >= 0:
            tree[i, j] = True
            j = parent[j]
    assert first_path(tree) == [0, 1, 3, 6]
    np.fill_diagonal(tree, True)
    assert first_path(tree) == [0, 1, 3, 6]
    assert first_path(np.eye(3, dtype=bool)) == [0]  # no match: the root alone
    with pytest.raises(ValueError, match="square"):
        first_path(np.ones((2, 3), bool))


def test_plan_never_cuts_a_sequence_with_drafts():
    drafted = [
        ScheduledSeq(
            token_ids=[7], num_computed=5, page_ids=[1, 2], sampling=SamplingRow(), draft_token_ids=[1, 2]
        )
        for _ in range(3)
    ]
    steps = plan_steps(drafted, page_size=4, max_tokens=7, max_seqs=4)
    # Three tokens each (the token, two drafts): two fit a 7-token step, the third goes next.
    assert [[p.index for p in s] for s in steps] == [[0, 1], [2]]
    assert all(p.last and p.seq is drafted[p.index] for s in steps for p in s)
    with pytest.raises(ValueError, match="verifying 2 drafts needs 3 tokens"):
        plan_steps(drafted[:1], page_size=4, max_tokens=2, max_seqs=4)

"""The spec-decode coordinator on stand-in sequences (no model): the drafting rule both callers
share, the proposal -> drafts -> verification -> catch-up cycle, with n-gram and a stand-in head."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from tpuserve.spec_decode.coordinator import (
    DraftFacts,
    DraftSupport,
    SpecDecodeCoordinator,
    draft_masks,
    may_draft,
)
from tpuserve.tpu_platform.draft_runner import DraftSeed

ENGINE = DraftSupport(token_masks=True, logprobs=False, penalties=False)
PLUGIN = DraftSupport(token_masks=False, logprobs=True, penalties=True)


def facts(**kw):
    base = dict(num_output_tokens=4, min_tokens=0, token_mask=False, logprobs=False, penalties=False)
    base.update(kw)
    return DraftFacts(**base)


@dataclass(eq=False)
class Seq:
    """Just what the coordinator reads of a sequence."""

    token_ids: list[int]
    num_computed: int
    num_pending: int = 0
    page_ids: list[int] = field(default_factory=lambda: [1, 2])
    is_finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return self.token_ids[start:end]


def decoding(tokens):
    return Seq(list(tokens), num_computed=len(tokens) - 1)


# ---- the rule ----


def test_plain_requests_draft_under_either_support():
    assert may_draft(facts(), ENGINE) and may_draft(facts(), PLUGIN)


def test_a_pending_min_tokens_ban_never_drafts():
    assert not may_draft(facts(num_output_tokens=3, min_tokens=4), ENGINE)
    assert not may_draft(facts(num_output_tokens=3, min_tokens=4), PLUGIN)
    assert may_draft(facts(num_output_tokens=4, min_tokens=4), PLUGIN)


@pytest.mark.parametrize(
    "what, engine, plugin",
    [("token_mask", True, False), ("logprobs", False, True), ("penalties", False, True)],
)
def test_what_a_caller_verifies_decides_the_rest(what, engine, plugin):
    assert may_draft(facts(**{what: True}), ENGINE) is engine
    assert may_draft(facts(**{what: True}), PLUGIN) is plugin


# ---- n-gram ----


def test_only_sequences_decoding_next_get_drafts():
    c = SpecDecodeCoordinator(3, max_model_len=100, support=ENGINE, lookup_range=(1, 3))
    motif = [7, 8, 9]
    dec, prefill = decoding(motif * 3), Seq(motif * 3, num_computed=2)
    counts = c.propose([(dec, facts()), (prefill, facts())])
    assert counts == {dec: 3}
    assert c.drafts([(dec, 3), (prefill, 0)]) == [[7, 8, 9], []]


def test_drafts_are_cut_to_what_was_scheduled_and_to_max_tokens():
    c = SpecDecodeCoordinator(4, max_model_len=100, support=ENGINE)
    c.drafter = lambda tokens, k: list(range(50, 50 + k))
    a, b = decoding([1, 2, 3]), decoding([4, 5, 6])
    # b may still generate 3 tokens: at most 2 drafts, so a full acceptance plus its bonus fits.
    assert c.propose([(a, facts()), (b, facts(tokens_left=3))]) == {a: 4, b: 2}
    assert c.drafts([(a, 1), (b, 2)]) == [[50], [50, 51]]  # the budget left a one draft


def test_a_request_the_rule_refuses_or_out_of_tokens_does_not_draft():
    c = SpecDecodeCoordinator(3, max_model_len=100, support=ENGINE)
    c.drafter = lambda tokens, k: [1] * k
    seqs = [decoding([1, 2]) for _ in range(3)]
    counts = c.propose([(seqs[0], facts(logprobs=True)), (seqs[1], facts(tokens_left=1)), (seqs[2], facts())])
    assert counts == {seqs[2]: 3}


def test_no_match_proposes_nothing():
    c = SpecDecodeCoordinator(3, max_model_len=100, support=ENGINE, lookup_range=(2, 2))
    assert c.propose([(decoding([1, 2, 3, 4]), facts())]) == {}


def test_verification_counts_as_vllm_does_and_keeps_the_accepted():
    c = SpecDecodeCoordinator(3, max_model_len=100, support=ENGINE)
    assert c.verified(3, 2) == 2
    assert c.verified(2, 0) == 0
    st = c.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (2, 5, 2)
    assert st.accepted_per_pos == [1, 1, 0]


# ---- a draft head ----


class FakeHead:
    """Records calls; its drafts are 100 + position, its seeds carry the sequence's next token."""

    def __init__(self):
        self.proposed, self.caught_up = [], []

    def propose(self, seeds, starts, page_lists, k):
        self.proposed.append((seeds, starts, k))
        return np.asarray([[s.first_token] + [100 + j for j in range(1, k)] for s in seeds])

    def catch_up(self, features, items):
        self.caught_up.append(items)
        return [DraftSeed(int(it.next_tokens[-1]), np.zeros(2)) for it in items]


def test_a_head_drafts_only_from_a_seed_made_at_the_current_length():
    head = FakeHead()
    c = SpecDecodeCoordinator(3, max_model_len=100, support=ENGINE, draft_runner=head)
    s = Seq([1, 2, 3, 4], num_computed=0)
    assert c.propose([(s, facts())]) == {}  # no seed yet
    # A step computed the prompt: [1, 2, 3] of it verified, token 4 (sampled there) is next.
    s.num_computed = 3
    c.catch_up("features", [(s, 0, 3)])
    (items,) = head.caught_up
    assert (items[0].row0, items[0].start, items[0].next_tokens) == (0, 0, [2, 3, 4])
    counts = c.propose([(s, facts())])
    assert counts == {s: 3}
    assert c.drafts([(s, 2)]) == [[4, 101]]
    seeds, starts, k = head.proposed[0]
    assert starts == [3] and k == 3  # always the configured k: one compiled program
    s.num_computed = 4  # another step moved on without a catch-up: the seed is stale
    assert c.propose([(s, facts())]) == {}


def test_catch_up_skips_finished_and_forget_drops_the_seed():
    head = FakeHead()
    c = SpecDecodeCoordinator(2, max_model_len=100, support=ENGINE, draft_runner=head)
    a, b = Seq([1, 2, 3], num_computed=2), Seq([4, 5, 6], num_computed=2, is_finished=True)
    c.catch_up("features", [(a, 0, 2), (b, 0, 2)])
    assert len(head.caught_up[0]) == 1 and head.caught_up[0][0].row0 == 0
    assert c.propose([(a, facts())]) == {a: 2}
    c.forget(a)
    assert c.propose([(a, facts())]) == {}


# ---- grammar masks ----


class CountingGrammar:
    """Accepts tokens below 10; its mask is the number of tokens accepted so far."""

    def __init__(self):
        self.n = 0

    def fill_bitmask(self):
        return np.asarray([self.n], np.int32)

    def accept(self, token_id):
        if token_id >= 10:
            return False
        self.n += 1
        return True

    def rollback(self, num_tokens):
        self.n -= num_tokens


def test_draft_masks_walk_the_drafts_and_roll_back():
    g = CountingGrammar()
    masks = draft_masks(g, [1, 2, 3], g.fill_bitmask())
    assert masks[:, 0].tolist() == [0, 1, 2, 3] and g.n == 0
    # A refused draft ends the walk: the rows after it reuse the last mask.
    masks = draft_masks(g, [1, 11, 2], g.fill_bitmask())
    assert masks[:, 0].tolist() == [0, 1, 1, 1] and g.n == 0

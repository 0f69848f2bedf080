"""The n-gram drafter on hand-worked cases (tests/vllm_plugin/test_ngram_oracle.py compares it with
vLLM's own implementation on thousands of random sequences, in the vLLM venv)."""

from __future__ import annotations

import numpy as np
import pytest

from tpuserve.spec_decode.ngram import NgramProposer, propose_ngram, resolve_lookup_range


def draft(tokens, min_n, max_n, k, max_model_len=1000):
    return propose_ngram(
        np.asarray(tokens), min_n=min_n, max_n=max_n, k=k, max_model_len=max_model_len
    ).tolist()


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, want",
    [
        # The suffix [1, 2, 3] occurred at the start: propose what followed it.
        ([1, 2, 3, 4, 1, 2, 3], 1, 3, 3, [4, 1, 2]),
        # The longest match wins over an earlier shorter one: [9, 7, 5, 3] at index 2 beats [5, 3] at 0 ...
        ([5, 3, 9, 7, 5, 3, 8, 9, 7, 5, 3], 1, 4, 3, [8, 9, 7]),
        # ... unless the lookup range stops at 2: then [5, 3] at index 0 is the earliest.
        ([5, 3, 9, 7, 5, 3, 8, 9, 7, 5, 3], 1, 2, 3, [9, 7, 5]),
        # Two occurrences of the same length: the earliest.
        ([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2, [7, 1]),
        # Fewer than k tokens follow the match.
        ([4, 4], 1, 3, 3, [4]),
        ([4, 4, 4], 1, 2, 3, [4]),
        # A match may overlap the suffix itself.
        ([1, 1, 1, 1], 1, 3, 3, [1]),
        # No match as long as prompt_lookup_min.
        ([1, 2, 3, 1, 2], 3, 4, 3, []),
        ([1, 2, 3], 1, 2, 3, []),
        ([7], 1, 1, 3, []),
        ([], 1, 1, 3, []),
    ],
)
def test_hand_worked_drafts(tokens, min_n, max_n, k, want):
    assert draft(tokens, min_n, max_n, k) == want


def test_max_model_len_caps_the_draft():
    tokens = [1, 2, 3, 1, 2]
    assert draft(tokens, 1, 2, 3, max_model_len=8) == [3, 1, 2]
    assert draft(tokens, 1, 2, 3, max_model_len=6) == [3]
    assert draft(tokens, 1, 2, 3, max_model_len=5) == []


def test_lookup_range_defaults_follow_vllm():
    assert resolve_lookup_range(None, None) == (5, 5)
    assert resolve_lookup_range(2, None) == (2, 2)
    assert resolve_lookup_range(None, 4) == (4, 4)
    assert resolve_lookup_range(2, 4) == (2, 4)
    for bad in ((3, 2), (0, 2)):
        with pytest.raises(ValueError):
            resolve_lookup_range(*bad)


def test_proposer_object():
    proposer = NgramProposer.create(num_speculative_tokens=2, max_model_len=100, prompt_lookup_max=3)
    assert (proposer.prompt_lookup_min, proposer.prompt_lookup_max) == (3, 3)
    ctx = [9, 8, 7, 6, 5, 9, 8, 7]
    assert proposer.propose(ctx).tolist() == [6, 5]
    assert proposer.propose(ctx, max_tokens=1).tolist() == [6]
    assert [d.tolist() for d in proposer.propose_batch([ctx, [1, 2, 3]])] == [[6, 5], []]
    with pytest.raises(ValueError):
        NgramProposer(0, 1, 1, 100)

"""Our n-gram drafter against vLLM's own (``vllm/v1/spec_decode/ngram_proposer.py``), in the vLLM venv.

vLLM's numba KMP search is the oracle: on many random token sequences (small vocabularies, so
n-grams repeat; long and short contexts; lookup ranges, k and max_model_len caps varied) the drafts
must be identical, including how many tokens are proposed.
"""

from __future__ import annotations

import numpy as np
import pytest

ngram_proposer = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")

from tpuserve.spec_decode.ngram import NgramProposer, propose_ngram  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def vllm_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    out = ngram_proposer._find_longest_matched_ngram_and_propose_tokens(
        origin_tokens=tokens, min_ngram=min_n, max_ngram=max_n, max_model_len=max_model_len, k=k
    )
    return [int(t) for t in out]


def random_case(rng: np.random.Generator):
    vocab = int(rng.choice([2, 3, 4, 8, 50]))
    n = int(rng.choice([0, 1, 2, 3, 5, 8, 13, 40, 120, 400]))
    if rng.random() < 0.3 and n > 4:
        # A repeated motif with noise: long matches and several occurrences of the same n-gram.
        motif = rng.integers(0, vocab, int(rng.integers(2, 7)))
        tokens = np.resize(motif, n)
        flips = rng.random(n) < 0.1
        tokens[flips] = rng.integers(0, vocab, int(flips.sum()))
    else:
        tokens = rng.integers(0, vocab, n)
    tokens = tokens.astype(np.int32)
    min_n = int(rng.integers(1, 5))
    max_n = min_n + int(rng.integers(0, 4))
    k = int(rng.integers(1, 9))
    # Sometimes the model length leaves room for fewer than k drafts (or none).
    max_model_len = n + int(rng.integers(0, 4)) if rng.random() < 0.3 else n + 1000
    return tokens, min_n, max_n, k, max_model_len


def test_drafts_match_vllm_on_random_sequences():
    rng = np.random.default_rng(1234)
    cases = nonempty = short = 0
    for _ in range(4000):
        tokens, min_n, max_n, k, max_len = random_case(rng)
        want = vllm_draft(tokens, min_n, max_n, k, max_len)
        got = propose_ngram(tokens, min_n=min_n, max_n=max_n, k=k, max_model_len=max_len).tolist()
        assert got == want, (tokens.tolist(), min_n, max_n, k, max_len)
        cases += 1
        nonempty += bool(want)
        short += 0 < len(want) < k
    # The sample exercised both outcomes and drafts cut short by the context end or max_model_len.
    assert nonempty > cases // 4 and cases - nonempty > cases // 20 and short > 50


def test_proposer_defaults_and_batch_match_vllm():
    """The proposer object with vLLM's default lookup range (5/5) and a batch of contexts."""
    rng = np.random.default_rng(7)
    proposer = NgramProposer.create(num_speculative_tokens=4, max_model_len=4096)
    assert (proposer.prompt_lookup_min, proposer.prompt_lookup_max) == (5, 5)
    motif = rng.integers(0, 1000, 12)
    contexts = [
        np.concatenate([rng.integers(0, 1000, 30), motif, rng.integers(0, 1000, 9), motif[:6]])
        for _ in range(8)
    ] + [rng.integers(0, 3, 60) for _ in range(8)]
    contexts = [c.astype(np.int32) for c in contexts]
    got = [d.tolist() for d in proposer.propose_batch(contexts)]
    want = [vllm_draft(c, 5, 5, 4, 4096) for c in contexts]
    assert got == want
    assert got[0] == motif[6:10].tolist()  # the motif's continuation after its first 6 tokens

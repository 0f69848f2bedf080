"""Tests of tpu_platform.sampler against independent numpy oracles (CPU JAX).

Distribution tests draw N samples in one call (N rows with the same logits and distinct seeds) and
compare the counts with the exact filtered distribution computed here in float64 numpy, by a
chi-square test; each has a negative control showing the same statistic rejects a wrong distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.tpu_platform import sampler as sampler_mod
from tpuserve.tpu_platform.step_batch import SamplingBatch

# One engine's sampler, shared by the module's tests (its programs compile once).
sampler = sampler_mod.Sampler()

NUM_DRAWS = 20000
# A correct sampler fails a check with probability 1e-3 per seed set; draws are seeded, so a pass
# is deterministic. Wrong distributions in the negative controls score p-values far below 1e-6.
ACCEPT_P = 1e-3
REJECT_P = 1e-6


# ------------------------------------------------------------------------------------------------
# numpy oracles
# ------------------------------------------------------------------------------------------------


def np_softmax_over(z: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """z [V] float64, keep [V] bool -> probabilities [V], zero outside keep."""
    w = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return w / w.sum()


def np_filtered_probs(
    row: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """Exact sampling distribution [V] of one row: temperature, then min-p, top-k, top-p (float64)."""
    z = row.astype(np.float64) / temperature
    vocab = z.size
    keep = np.ones(vocab, bool)
    if min_p > 0.0:
        p = np_softmax_over(z, keep)
        keep &= p >= min_p * p.max()
    if 0 < top_k < vocab:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p < 1.0:
        p = np_softmax_over(z, keep)
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # Smallest prefix whose mass reaches top_p; the fixtures keep top_p away from any cum value.
        assert np.min(np.abs(cum - top_p)) > 1e-3, "fixture puts top_p on a boundary"
        n = int(np.argmax(cum >= top_p)) + 1
        nucleus = np.zeros(vocab, bool)
        nucleus[order[:n]] = True
        keep &= nucleus
    return np_softmax_over(z, keep)


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def np_penalize(
    logits: np.ndarray,
    counts: np.ndarray | None,
    prompt_mask: np.ndarray | None,
    rep: np.ndarray,
    pres: np.ndarray,
    freq: np.ndarray,
) -> np.ndarray:
    """vLLM's penalties, written row by row in float64."""
    out = logits.astype(np.float64).copy()
    for i in range(out.shape[0]):
        seen = np.zeros(out.shape[1], bool)
        if prompt_mask is not None:
            seen |= prompt_mask[i]
        if counts is not None:
            seen |= counts[i] > 0
        for v in np.nonzero(seen)[0]:
            out[i, v] = out[i, v] / rep[i] if out[i, v] > 0 else out[i, v] * rep[i]
        if counts is not None:
            out[i] -= freq[i] * counts[i]
            out[i] -= pres[i] * (counts[i] > 0)
    return out


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of counts [V] to probs [V]; a draw outside the support of probs gives 0."""
    if np.any(counts[probs == 0] > 0):
        return 0.0
    support = probs > 0
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    expected = counts.sum() * probs[support]
    stat = float(np.sum((counts[support] - expected) ** 2 / expected))
    # Survival function of chi-square(dof) = regularised upper incomplete gamma Q(dof/2, stat/2).
    return float(jax.scipy.special.gammaincc(dof / 2.0, stat / 2.0))


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def make_batch(num_rows: int, **fields) -> SamplingBatch:
    """A greedy batch of num_rows with fields overridden (scalars broadcast to [S])."""
    batch = SamplingBatch.greedy(num_rows)
    for name, value in fields.items():
        current = getattr(batch, name)
        if isinstance(current, np.ndarray) and np.ndim(value) == 0:
            current[:] = value
        else:
            setattr(batch, name, value)
    return batch


def draw_counts(row: np.ndarray, n: int = NUM_DRAWS, seed_offset: int = 0, **fields) -> np.ndarray:
    """Sample n times from the same logits row [V] (n rows, distinct seeds) -> token counts [V]."""
    logits = jnp.asarray(np.tile(row.astype(np.float32), (n, 1)))
    batch = make_batch(n, **fields)
    batch.seeds = np.arange(seed_offset, seed_offset + n, dtype=np.uint32)
    batch.steps = np.full(n, 3, np.int32)
    out = sampler.sample(logits, batch)
    return np.bincount(out.token_ids, minlength=row.size)


def bitmask_from_allowed(allowed: np.ndarray) -> np.ndarray:
    """allowed [S, V] bool -> [S, ceil(V/32)] i32 in xgrammar's layout (bit j of word w = token 32w+j)."""
    num_rows, vocab = allowed.shape
    words = np.zeros((num_rows, (vocab + 31) // 32), np.uint32)
    for i, v in zip(*np.nonzero(allowed)):
        words[i, v // 32] |= np.uint32(1) << np.uint32(v % 32)
    return words.view(np.int32)


# Fixed row with distinct, moderately spread logits; V = 32.
ROW = np.random.default_rng(7).normal(size=32).astype(np.float32) * 1.5


# ------------------------------------------------------------------------------------------------
# greedy and padding
# ------------------------------------------------------------------------------------------------


def test_greedy_matches_numpy_argmax_and_padding_rows():
    rng = np.random.default_rng(0)
    logits = np.zeros((8, 1000), np.float32)
    logits[:5] = rng.normal(size=(5, 1000))  # rows 5..7 are padding (all-zero logits)
    out = sampler.sample(jnp.asarray(logits), SamplingBatch.greedy(8))
    assert out.token_ids.dtype == np.int32 and out.token_ids.shape == (8,)
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=-1))
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_stay_argmax():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 300)).astype(np.float32)
    batch = make_batch(6, temperature=np.array([0, 1.0, 0, 0.7, 0, 0], np.float32), top_k=5, top_p=0.5)
    batch.seeds = np.arange(6, dtype=np.uint32)
    out = sampler.sample(jnp.asarray(logits), batch)
    greedy = batch.temperature == 0
    np.testing.assert_array_equal(out.token_ids[greedy], np.argmax(logits, axis=-1)[greedy])


# ------------------------------------------------------------------------------------------------
# seeded reproducibility
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_seeded_draw_independent_of_batch_composition_and_position():
    rng = np.random.default_rng(2)
    vocab = 64
    row = (rng.normal(size=vocab) * 0.3).astype(np.float32)  # flat: the draw is mostly randomness
    n = 40
    seeds = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    steps = rng.integers(0, 10_000, size=n).astype(np.int32)

    alone = make_batch(n, temperature=1.0)
    alone.seeds, alone.steps = seeds, steps
    ref = sampler.sample(jnp.asarray(np.tile(row, (n, 1))), alone).token_ids

    # The same rows, shuffled into a larger batch whose other rows switch on top-k/top-p, penalties,
    # logprobs and greedy decoding, so a different compiled variant runs.
    total = 3 * n + 5
    where = rng.permutation(total)[:n]
    logits = rng.normal(size=(total, vocab)).astype(np.float32)
    logits[where] = row
    mixed = make_batch(total, temperature=rng.choice([0.0, 0.5, 1.3], size=total).astype(np.float32))
    mixed.top_k = rng.integers(0, 10, size=total).astype(np.int32)
    mixed.top_p = rng.choice([0.6, 1.0], size=total).astype(np.float32)
    mixed.repetition_penalty = rng.choice([1.0, 1.3], size=total).astype(np.float32)
    mixed.frequency_penalty = rng.choice([0.0, 0.4], size=total).astype(np.float32)
    mixed.output_counts = rng.integers(0, 3, size=(total, vocab)).astype(np.int32)
    mixed.seeds = rng.integers(0, 2**32, size=total, dtype=np.uint64).astype(np.uint32)
    mixed.steps = rng.integers(0, 100, size=total).astype(np.int32)
    mixed.num_logprobs = 2
    # Our rows: plain temperature 1, neutral penalties (their counts may be anything), own seed/step.
    mixed.temperature[where] = 1.0
    mixed.top_k[where] = 0
    mixed.top_p[where] = 1.0
    mixed.repetition_penalty[where] = 1.0
    mixed.frequency_penalty[where] = 0.0
    mixed.seeds[where], mixed.steps[where] = seeds, steps
    got = sampler.sample(jnp.asarray(logits), mixed).token_ids[where]
    np.testing.assert_array_equal(got, ref)

    # Same call again: same tokens.
    np.testing.assert_array_equal(sampler.sample(jnp.asarray(np.tile(row, (n, 1))), alone).token_ids, ref)


def test_different_steps_and_seeds_give_different_draws():
    vocab = 64
    n = 256
    logits = jnp.zeros((n, vocab), jnp.float32)  # uniform distribution
    by_step = make_batch(
        n, temperature=1.0, seeds=np.full(n, 99, np.uint32), steps=np.arange(n, dtype=np.int32)
    )
    by_seed = make_batch(n, temperature=1.0, seeds=np.arange(n, dtype=np.uint32), steps=np.zeros(n, np.int32))
    for batch in (by_step, by_seed):
        tokens = sampler.sample(logits, batch).token_ids
        # 256 uniform draws over 64 tokens hit ~63 distinct ids; a key ignoring step/seed hits 1.
        assert len(np.unique(tokens)) > 40


# ------------------------------------------------------------------------------------------------
# distributions (chi-square)
# ------------------------------------------------------------------------------------------------

CASES = {
    "temperature": dict(temperature=0.6),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "combined": dict(temperature=0.7, top_k=12, top_p=0.8, min_p=0.05),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_sampling_distribution_matches_exact_filtered_distribution(case):
    params = CASES[case]
    exact = np_filtered_probs(ROW, **params)
    counts = draw_counts(ROW, **params)
    assert counts.sum() == NUM_DRAWS
    # No mass outside the kept set.
    assert counts[exact == 0].sum() == 0
    if case != "temperature":
        assert (exact == 0).any(), "fixture: the filter should remove something"
    assert chi2_pvalue(counts, exact) > ACCEPT_P

    # Negative controls: the same statistic rejects wrong distributions.
    unfiltered = np_filtered_probs(ROW)
    assert chi2_pvalue(counts, unfiltered) < REJECT_P
    if case != "temperature":
        # Right filter, wrong temperature (renormalised over the right support): still rejected.
        off_temp = np.where(exact > 0, np_filtered_probs(ROW, temperature=params["temperature"] * 1.3), 0.0)
        assert chi2_pvalue(counts, off_temp / off_temp.sum()) < REJECT_P


def test_chi_square_negative_control_on_filter_support():
    """A top-p filter keeping one token too many must be rejected by the zero-mass / chi-square check."""
    exact = np_filtered_probs(ROW, top_p=0.7)
    kept = np.nonzero(exact)[0]
    # Add the next most likely token to the support: a plausible off-by-one in the nucleus.
    z = ROW.astype(np.float64)
    outside = [v for v in np.argsort(-z) if v not in kept][0]
    wider_keep = exact > 0
    wider_keep[outside] = True
    wider = np_softmax_over(z, wider_keep)
    counts = draw_counts(ROW, top_p=0.7, temperature=1.0, seed_offset=10**6)
    assert chi2_pvalue(counts, exact) > ACCEPT_P
    assert chi2_pvalue(counts, wider) < REJECT_P


def test_tiny_top_p_always_keeps_the_top_token():
    for top_p in (0.0, 1e-6):
        exact = np_filtered_probs(ROW, top_p=top_p)
        assert exact[int(np.argmax(ROW))] == 1.0
        counts = draw_counts(ROW, n=512, temperature=1.0, top_p=top_p)
        assert counts[int(np.argmax(ROW))] == 512


def test_greedy_rows_ignore_filters_but_small_temperature_is_random():
    # temperature 1e-6 is greedy even with top-k on; 0.5 on a flat row spreads.
    n = 512
    row = np.linspace(0.0, 0.1, 16).astype(np.float32)
    counts_greedy = draw_counts(row, n=n, temperature=1e-6, top_k=4)
    assert counts_greedy[15] == n
    counts_random = draw_counts(row, n=n, temperature=0.5)
    assert (counts_random > 0).sum() > 10


# ------------------------------------------------------------------------------------------------
# penalties, banned ids, bitmask
# ------------------------------------------------------------------------------------------------


def penalty_fixture(num_rows: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(num_rows, vocab)) * 2.0).astype(np.float32)
    counts = (rng.integers(0, 4, size=(num_rows, vocab)) * (rng.random((num_rows, vocab)) < 0.3)).astype(
        np.int32
    )
    prompt = rng.random((num_rows, vocab)) < 0.2
    rep = rng.uniform(1.0, 2.0, size=num_rows).astype(np.float32)
    pres = rng.uniform(0.0, 1.0, size=num_rows).astype(np.float32)
    freq = rng.uniform(0.0, 1.0, size=num_rows).astype(np.float32)
    rep[0], pres[0], freq[0] = 1.0, 0.0, 0.0  # one neutral row
    return logits, counts, prompt, rep, pres, freq


def test_penalty_values_match_numpy():
    logits, counts, prompt, rep, pres, freq = penalty_fixture(16, 40, seed=3)
    got = sampler_mod._apply_penalties(
        jnp.asarray(logits),
        jnp.asarray(rep),
        output_counts=jnp.asarray(counts),
        prompt_mask=jnp.asarray(prompt),
        presence=jnp.asarray(pres),
        frequency=jnp.asarray(freq),
    )
    want = np_penalize(logits, counts, prompt, rep, pres, freq)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[0], logits[0])  # neutral row untouched, bit for bit


@pytest.mark.parametrize("which", ["both", "counts_only", "prompt_only"])
def test_penalized_greedy_matches_numpy(which):
    logits, counts, prompt, rep, pres, freq = penalty_fixture(256, 64, seed=4)
    use_counts = which in ("both", "counts_only")
    use_prompt = which in ("both", "prompt_only")
    batch = make_batch(256, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    batch.output_counts = counts if use_counts else None
    batch.prompt_mask = prompt if use_prompt else None
    want = np.argmax(
        np_penalize(logits, counts if use_counts else None, prompt if use_prompt else None, rep, pres, freq),
        axis=-1,
    )
    got = sampler.sample(jnp.asarray(logits), batch).token_ids
    np.testing.assert_array_equal(got, want)
    # The fixture must make penalties matter, or this test could not fail.
    assert (want != np.argmax(logits, axis=-1)).sum() > 20


def test_banned_ids_never_sampled_and_padding_bans_nothing():
    vocab, n = 50, 2000
    row = np.zeros(vocab, np.float32)
    row[:5] = 5.0  # the banned tokens would take almost all the mass
    banned = np.tile(np.array([0, 1, 2, 3, 4, -1, -1], np.int32), (n, 1))
    counts = draw_counts(row, n=n, temperature=1.0, banned_ids=banned)
    assert counts[:5].sum() == 0
    assert (counts[5:] > 0).sum() > 30

    # Greedy: a banned argmax falls to the runner-up; -1 padding must not ban token V-1.
    logits = np.zeros((2, vocab), np.float32)
    logits[0, 7], logits[0, 9] = 3.0, 2.0
    logits[1, vocab - 1] = 3.0
    batch = make_batch(2, banned_ids=np.array([[7, -1], [-1, -1]], np.int32))
    np.testing.assert_array_equal(sampler.sample(jnp.asarray(logits), batch).token_ids, [9, vocab - 1])


@pytest.mark.timeout(120)
def test_bitmask_respected_and_distribution_renormalised():
    vocab, n = 100, 8000  # V not a multiple of 32: the last word is partial
    rng = np.random.default_rng(5)
    row = (rng.normal(size=vocab)).astype(np.float32)
    allowed = rng.random(vocab) < 0.3
    allowed[[31, 63, 99]] = True  # bit 31 is the sign bit of an int32 word; 99 sits in the partial word
    allowed[int(np.argmax(row))] = False  # the unmasked favourite is forbidden
    mask = bitmask_from_allowed(np.tile(allowed, (n, 1)))
    counts = draw_counts(row, n=n, temperature=1.0, token_bitmask=mask)
    assert counts[~allowed].sum() == 0
    exact = np_softmax_over(row.astype(np.float64), allowed)
    assert chi2_pvalue(counts, exact) > ACCEPT_P

    # Greedy picks the best allowed token, including one behind the sign bit.
    logits = np.stack([row, np.where(np.arange(vocab) == 31, 10.0, row).astype(np.float32)])
    batch = make_batch(2, token_bitmask=bitmask_from_allowed(np.tile(allowed, (2, 1))))
    best_allowed = int(np.argmax(np.where(allowed, row, -np.inf)))
    np.testing.assert_array_equal(sampler.sample(jnp.asarray(logits), batch).token_ids, [best_allowed, 31])


# ------------------------------------------------------------------------------------------------
# logprobs
# ------------------------------------------------------------------------------------------------


def test_sample_logprobs_are_raw_log_softmax_with_ranks_and_top_k():
    rng = np.random.default_rng(6)
    num_rows, vocab = 6, 200
    logits = (rng.normal(size=(num_rows, vocab)) * 2).astype(np.float32)
    batch = make_batch(
        num_rows,
        temperature=np.array([0, 0.8, 1.5, 0, 2.0, 1.0], np.float32),
        repetition_penalty=1.5,
        seeds=np.arange(num_rows, dtype=np.uint32),
        num_logprobs=5,
    )
    batch.output_counts = np.zeros((num_rows, vocab), np.int32)
    batch.output_counts[:, np.argsort(-logits, axis=-1)[0, :3]] = 1  # penalties change processed logits
    out = sampler.sample(jnp.asarray(logits), batch)
    lp = np_log_softmax(logits)
    rows = np.arange(num_rows)
    tok = out.token_ids
    np.testing.assert_allclose(out.logprobs.token_logprobs, lp[rows, tok], atol=1e-5)
    np.testing.assert_array_equal(out.logprobs.token_ranks, 1 + (lp > lp[rows, tok][:, None]).sum(-1))
    assert out.logprobs.token_ranks.dtype == np.int32
    # Some random row should not have drawn the top token, or the rank check is vacuous.
    assert (out.logprobs.token_ranks > 1).any()
    top = np.argsort(-lp, axis=-1, kind="stable")[:, :5]
    np.testing.assert_array_equal(out.logprobs.top_ids, top)
    np.testing.assert_allclose(out.logprobs.top_logprobs, np.take_along_axis(lp, top, -1), atol=1e-5)


def test_zero_logprobs_gives_empty_top_arrays():
    logits = jnp.asarray(np.random.default_rng(8).normal(size=(3, 50)).astype(np.float32))
    out = sampler.sample(logits, make_batch(3, num_logprobs=0))
    assert out.logprobs.top_ids.shape == (3, 0) and out.logprobs.top_logprobs.shape == (3, 0)
    np.testing.assert_array_equal(out.logprobs.token_ranks, [1, 1, 1])


def test_compute_logprobs_matches_numpy_and_ranks_ties():
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(10, 300)).astype(np.float32)
    targets = rng.integers(0, 300, size=10)
    got = sampler.compute_logprobs(jnp.asarray(logits), targets, num_top=3)
    lp = np_log_softmax(logits)
    rows = np.arange(10)
    np.testing.assert_allclose(got.token_logprobs, lp[rows, targets], atol=1e-5)
    np.testing.assert_array_equal(got.token_ranks, 1 + (lp > lp[rows, targets][:, None]).sum(-1))
    np.testing.assert_array_equal(got.top_ids, np.argsort(-lp, axis=-1)[:, :3])

    # Hand-checked ranks with ties: [1, 3, 3, 0, 2] -> token 2 ties for first, 4 is third, 3 is fifth.
    tie_logits = jnp.asarray(np.tile(np.array([1.0, 3.0, 3.0, 0.0, 2.0], np.float32), (3, 1)))
    tied = sampler.compute_logprobs(tie_logits, [2, 4, 3], num_top=0)
    np.testing.assert_array_equal(tied.token_ranks, [1, 3, 5])
    assert tied.top_ids.shape == (3, 0)


# ------------------------------------------------------------------------------------------------
# compilation variants
# ------------------------------------------------------------------------------------------------


def test_compile_count_one_trace_per_variant_and_shape():
    logits = jnp.asarray(np.random.default_rng(10).normal(size=(3, 77)).astype(np.float32))  # unique shape
    start = sampler.compile_count()
    sampler.sample(logits, SamplingBatch.greedy(3))
    assert sampler.compile_count() == start + 1
    sampler.sample(logits, SamplingBatch.greedy(3))
    assert sampler.compile_count() == start + 1  # cached
    random_batch = make_batch(3, temperature=0.9, seeds=np.array([1, 2, 3], np.uint32))
    sampler.sample(logits, random_batch)
    assert sampler.compile_count() == start + 2  # new variant
    sampler.sample(logits, make_batch(3, temperature=0.5, seeds=np.array([4, 5, 6], np.uint32)))
    assert sampler.compile_count() == start + 2  # same variant, new values
    sampler.sample(logits[:2], SamplingBatch.greedy(2))
    assert sampler.compile_count() == start + 3  # new shape


def test_all_greedy_program_is_argmax_only():
    logits = jnp.zeros((4, 64), jnp.float32)
    greedy_text = sampler._lowered_text(logits, SamplingBatch.greedy(4))
    filtered = make_batch(4, temperature=1.0, top_k=3)
    filtered_text = sampler._lowered_text(logits, filtered)
    # Positive control: the inspection does see the filters' bisection loops and the PRNG when
    # they are there.
    assert "while" in filtered_text and "threefry" in filtered_text
    assert "while" not in greedy_text and "threefry" not in greedy_text

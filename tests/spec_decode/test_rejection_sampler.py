"""The device rejection sampler: its output follows the target distribution whatever the drafts are.

Statistics: N sequences verify K = 2 drafts each against fixed target rows p_0, p_1, p_2; the first
emitted token must follow p_0, the second (when the first draft was accepted) p_1, and the bonus
(both accepted) p_2. Pearson's chi-square at significance ALPHA against the numpy-built p is the
judge (the critical value comes from tests/spec_decode/chi_square.py, itself checked against a
published table), and the same test must reject the classic bug of resampling a rejected row from p
instead of the residual. The seeds are fixed, so each check is deterministic.
Greedy rows are checked against a plain-Python reading of the greedy rule.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import chi2_critical, goodness_of_fit

from tpuserve.tpu_platform.rejection_sampler import RejectionSampler
from tpuserve.tpu_platform.sampler import Sampler
from tpuserve.tpu_platform.step_batch import SamplingBatch

pytestmark = pytest.mark.timeout(600)

# One engine's sampler and verifier, shared by the module's tests (programs compile once).
sampler = Sampler()
rs = RejectionSampler(sampler)

ALPHA = 1e-4
N = 100_000
K = 2
V = 6

P_ROWS = np.array(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],  # token 5 is impossible (as if masked by top-k)
        [0.05, 0.10, 0.40, 0.05, 0.20, 0.20],
        [0.50, 0.02, 0.03, 0.15, 0.00, 0.30],
    ]
)


def log(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(p).astype(np.float32)


def rows_for(num_seqs: int, k: int, temperature: float = 1.0, seed0: int = 0, **params) -> SamplingBatch:
    """Sampling rows of num_seqs sequences with k drafts each: row j of sequence i has seed seed0 + i
    and step j (what ModelRunner's row expansion gives a sequence at step 0)."""
    rows = SamplingBatch.greedy(num_seqs * (k + 1))
    rows.temperature[:] = temperature
    rows.seeds[:] = np.repeat(np.arange(num_seqs) + seed0, k + 1).astype(np.uint32)
    rows.steps[:] = np.tile(np.arange(k + 1), num_seqs)
    for name, value in params.items():
        getattr(rows, name)[:] = value
    return rows


def verify(
    x_rows: np.ndarray, drafts: np.ndarray, q: np.ndarray | None = None, *, rows=None, wrong: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Every sequence verifies drafts [N, K] against the same logits rows x_rows [K+1, V]."""
    n, k = drafts.shape
    logits = jnp.asarray(np.tile(x_rows, (n, 1)))
    cu = np.arange(0, n * (k + 1) + 1, k + 1, dtype=np.int32)
    rows = rows if rows is not None else rows_for(n, k)
    v = rs.verify_async(
        logits,
        rows,
        drafts.astype(np.int32),
        cu,
        None if q is None else jnp.asarray(q),
        resample_from_target=wrong,
    )
    return np.asarray(v.token_ids), np.asarray(v.num_accepted)


def sample_drafts(rng: np.random.Generator, q: np.ndarray) -> np.ndarray:
    """q [N, K, V] -> drafts [N, K], each drawn from its own distribution."""
    u = rng.random(q.shape[:2])[..., None]
    return (np.cumsum(q, axis=-1) < u).sum(axis=-1).clip(max=q.shape[-1] - 1).astype(np.int32)


def fit(tokens: np.ndarray, accepted: np.ndarray, p_rows: np.ndarray) -> list[tuple[float, float, int]]:
    """(statistic, critical value, samples) of the first token vs p_0, the second given the first
    draft accepted vs p_1, and the bonus given both accepted vs p_2."""
    out = []
    for j in range(tokens.shape[1]):
        got = tokens[accepted >= j, j]
        stat, dof = goodness_of_fit(got, p_rows[j])
        out.append((stat, chi2_critical(ALPHA, dof), len(got)))
    return out


def assert_follows(results, min_samples: int = 2000) -> None:
    for j, (stat, crit, n) in enumerate(results):
        assert n >= min_samples, f"position {j}: only {n} samples"
        assert stat < crit, f"position {j}: chi2 {stat:.1f} >= {crit:.1f} over {n} samples"


def test_random_draft_distributions():
    """Every sequence has its own draft distributions (Dirichlet), drafts drawn from them."""
    rng = np.random.default_rng(0)
    q = rng.dirichlet(np.full(V, 0.7), size=(N, K)).astype(np.float32)
    drafts = sample_drafts(rng, q)
    tokens, accepted = verify(log(P_ROWS), drafts, q)
    assert_follows(fit(tokens, accepted, P_ROWS))


def test_draft_distribution_far_from_target():
    """q puts most of its mass where p has little or none (token 5 is impossible at position 0)."""
    rng = np.random.default_rng(1)
    q_rows = np.array(
        [[0.02, 0.02, 0.02, 0.04, 0.20, 0.70], [0.40, 0.05, 0.05, 0.40, 0.05, 0.05]], np.float32
    )
    q = np.broadcast_to(q_rows, (N, K, V)).copy()
    drafts = sample_drafts(rng, q)
    tokens, accepted = verify(log(P_ROWS), drafts, q)
    assert_follows(fit(tokens, accepted, P_ROWS))
    assert (accepted >= 1).mean() == pytest.approx(np.minimum(P_ROWS[0], q_rows[0]).sum(), abs=0.01)


# How the one-hot tests pick drafts (skewed: with uniform drafts, resampling from p would happen to
# give p too, and the negative control could not tell).
DRAFT_CHOICE = np.array([[0.10, 0.10, 0.10, 0.30, 0.30, 0.10], [0.05, 0.05, 0.60, 0.10, 0.10, 0.10]])


def test_one_hot_drafts():
    """No draft distribution (n-gram): each draft counts as certain, whichever token it is, including
    one the target cannot produce."""
    rng = np.random.default_rng(2)
    drafts = sample_drafts(rng, np.broadcast_to(DRAFT_CHOICE, (N, K, V)))
    tokens, accepted = verify(log(P_ROWS), drafts)
    assert_follows(fit(tokens, accepted, P_ROWS))
    # One-hot acceptance is p(d): averaged over the drafts, sum_d choice(d) p(d).
    assert (accepted >= 1).mean() == pytest.approx(DRAFT_CHOICE[0] @ P_ROWS[0], abs=0.01)


@pytest.mark.parametrize("one_hot", [False, True])
def test_negative_control_resampling_from_target_fails(one_hot):
    """The same statistics catch a sampler that redraws rejected rows from p, not the residual."""
    rng = np.random.default_rng(3)
    q = None if one_hot else rng.dirichlet(np.full(V, 0.7), size=(N, K)).astype(np.float32)
    drafts = sample_drafts(rng, np.broadcast_to(DRAFT_CHOICE, (N, K, V)) if one_hot else q)
    tokens, accepted = verify(log(P_ROWS), drafts, q, wrong=True)
    stat, crit, _ = fit(tokens, accepted, P_ROWS)[0]
    assert stat > 10 * crit, (stat, crit)


def numpy_target(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution vLLM's processing defines for one row (distinct logits, so no ties):
    temperature, min-p (prob >= min_p * max prob), top-k, then the smallest top-p nucleus of the
    top-k set renormalised."""
    y = x.astype(np.float64) / temperature
    p = np.exp(y - y.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-np.where(keep, p, -1.0))
    keep_k = np.zeros_like(keep)
    keep_k[order[:top_k]] = True
    keep &= keep_k
    pk = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    ranked = np.argsort(-pk)
    mass_before = np.cumsum(pk[ranked]) - pk[ranked]
    nucleus = np.zeros_like(keep)
    nucleus[ranked[mass_before < top_p]] = True
    keep &= nucleus
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def test_target_is_the_samplers_processed_distribution():
    """Temperature, min-p, top-k and top-p shape p exactly as the plain sampler's processing does."""
    rng = np.random.default_rng(4)
    vocab = 10
    x_rows = rng.normal(0, 1.5, size=(K + 1, vocab)).astype(np.float32)
    params = dict(temperature=0.7, top_k=6, top_p=0.85, min_p=0.03)
    p_rows = np.stack([numpy_target(r, **params) for r in x_rows])
    assert ((p_rows > 0).sum(axis=1) < vocab).all()  # the filters did cut something
    # Drafts lean to likely tokens, so enough samples reach the bonus row.
    r = (p_rows[:K] + 0.05) / (p_rows[:K] + 0.05).sum(axis=1, keepdims=True)
    drafts = sample_drafts(rng, np.broadcast_to(r, (N, K, vocab)))
    rows = rows_for(N, K, **params)
    tokens, accepted = verify(x_rows, drafts, rows=rows)
    assert_follows(fit(tokens, accepted, p_rows))


def greedy_reference(targets: list[list[int]], drafts: list[list[int]]) -> list[list[int]]:
    """The greedy rule read literally: emit target j while draft j equals it, then the target at the
    first mismatch (or the bonus)."""
    out = []
    for t, d in zip(targets, drafts):
        new = []
        for j in range(len(d) + 1):
            new.append(t[j])
            if j == len(d) or d[j] != t[j]:
                break
        out.append(new)
    return out


@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_rows_follow_the_argmax(mixed):
    """Greedy rows alone (the sampler's argmax + accept_greedy) and beside a random row (inside the
    rejection program) give the greedy rule's tokens; draft counts vary, some sequences have none."""
    rng = np.random.default_rng(5)
    vocab, k_slots = 50, 4
    n_drafts = [3, 0, 4, 1, 2, 4, 0]
    num_rows = sum(n + 1 for n in n_drafts) + 5  # padding rows at the end
    logits = rng.normal(size=(num_rows, vocab)).astype(np.float32)
    argmax = logits.argmax(axis=1)
    cu = np.concatenate([[0], np.cumsum([n + 1 for n in n_drafts])]).astype(np.int32)
    drafts = np.full((len(n_drafts) + (1 if mixed else 0), k_slots), -1, np.int32)
    targets, draft_lists = [], []
    for i, n in enumerate(n_drafts):
        t = argmax[cu[i] : cu[i] + n + 1]
        # Mostly right drafts with an occasional wrong one, so every acceptance length shows up.
        d = np.where(rng.random(n) < 0.75, t[:n], (t[:n] + 1) % vocab)
        drafts[i, :n] = d
        targets.append(t.tolist())
        draft_lists.append(d.tolist())
    rows = SamplingBatch.greedy(num_rows)
    if mixed:
        # One more sequence that samples: a random row in the batch switches on the rejection program.
        cu = np.append(cu, cu[-1] + 1).astype(np.int32)
        rows.temperature[cu[-2]] = 1.0
    v = rs.verify_async(jnp.asarray(logits), rows, drafts, cu)
    token_ids, accepted = np.asarray(v.token_ids), np.asarray(v.num_accepted)
    want = greedy_reference(targets, draft_lists)
    got = [token_ids[i, : accepted[i] + 1].tolist() for i in range(len(n_drafts))]
    assert got == want
    assert all((token_ids[i, accepted[i] + 1 :] == -1).all() for i in range(len(n_drafts)))
    assert sorted(set(accepted[: len(n_drafts)].tolist())) != [0]  # some accepted, some not


def test_same_seed_and_steps_give_the_same_tokens_anywhere_in_the_batch():
    """A sequence's tokens depend on its (seed, steps) and logits only: not on its slot, its
    neighbours, or the call."""
    rng = np.random.default_rng(6)
    vocab, k = 12, 3
    x = rng.normal(size=(k + 1, vocab)).astype(np.float32)
    drafts = np.array([[1, 2, 3]], np.int32)

    def run(slot: int, num_seqs: int, neighbour_seed: int):
        rows = rows_for(num_seqs, k, seed0=neighbour_seed)
        rows.seeds[slot * (k + 1) : (slot + 1) * (k + 1)] = 777
        rows.steps[slot * (k + 1) : (slot + 1) * (k + 1)] = np.arange(10, 10 + k + 1)
        logits = np.tile(rng.normal(size=(k + 1, vocab)).astype(np.float32), (num_seqs, 1))
        logits[slot * (k + 1) : (slot + 1) * (k + 1)] = x
        all_drafts = rng.integers(0, vocab, size=(num_seqs, k)).astype(np.int32)
        all_drafts[slot] = drafts
        cu = np.arange(0, num_seqs * (k + 1) + 1, k + 1, dtype=np.int32)
        v = rs.verify_async(jnp.asarray(logits), rows, all_drafts, cu)
        return np.asarray(v.token_ids)[slot].tolist(), int(np.asarray(v.num_accepted)[slot])

    first = run(0, 1, 0)
    assert run(0, 1, 0) == first
    assert run(2, 4, 100) == first
    assert run(1, 3, 5000) == first
    # Other seeds do give other outcomes (the check above is not vacuous).
    outcomes = set()
    for seed in range(40):
        rows = rows_for(1, k, seed0=seed)
        v = rs.verify_async(jnp.asarray(x), rows, drafts, np.array([0, k + 1], np.int32))
        outcomes.add(tuple(np.asarray(v.token_ids)[0].tolist()))
    assert len(outcomes) > 3


def test_rows_without_a_draft_draw_what_plain_sampling_draws():
    """A sequence with no draft, and the bonus row, use the plain sampler's key for their token index,
    so they draw exactly what ``sampler.sample`` draws for the same (seed, step)."""
    rng = np.random.default_rng(7)
    vocab = 30
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    # Sequence 0 verifies one draft it is sure to keep (p(d) ~ 1 at T = 0.05 on a dominant logit);
    # sequence 1 has no draft.
    logits[0, 5] += 30.0
    cu = np.array([0, 2, 3], np.int32)
    drafts = np.array([[5], [-1]], np.int32)
    rows = SamplingBatch.greedy(4)
    rows.temperature[:] = [0.05, 0.05, 0.9, 0.9]
    rows.seeds[:] = [11, 11, 22, 22]
    rows.steps[:] = [40, 41, 7, 0]
    v = rs.verify_async(jnp.asarray(logits), rows, drafts, cu)
    token_ids, accepted = np.asarray(v.token_ids), np.asarray(v.num_accepted)
    assert accepted.tolist() == [1, 0] and token_ids[0, 0] == 5
    plain = SamplingBatch.greedy(2)
    plain.temperature[:] = [0.05, 0.9]
    plain.seeds[:] = [11, 22]
    plain.steps[:] = [41, 7]
    want = sampler.sample(jnp.asarray(logits[[1, 2]]), plain).token_ids
    assert [token_ids[0, 1], token_ids[1, 0]] == want.tolist()


def test_logprobs_score_the_emitted_tokens():
    rng = np.random.default_rng(8)
    vocab, k = 16, 2
    logits = rng.normal(size=(k + 1, vocab)).astype(np.float32)
    rows = rows_for(1, k, seed0=3)
    rows.num_logprobs = 2
    v = rs.verify_async(
        jnp.asarray(logits),
        rows,
        np.array([[4, 9]], np.int32),
        np.array([0, k + 1], np.int32),
        max_logprobs=5,
    )
    token_ids, n = np.asarray(v.token_ids)[0], int(np.asarray(v.num_accepted)[0])
    lp = np.asarray(v.logprobs[0])
    ref = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    for j in range(n + 1):
        assert lp[j] == pytest.approx(ref[j, token_ids[j]], abs=1e-5)


def test_compiles_once_per_shape():
    vocab = 20
    shapes = [(8, 2, 3)]
    rs.warmup(shapes, vocab, draft_probs=True)
    before = rs.compile_count()
    assert rs.warmup(shapes, vocab, draft_probs=True) == 0
    rng = np.random.default_rng(9)
    for temperature in (0.0, 0.5, 1.0):
        rows = rows_for(2, 3, temperature=temperature)
        drafts = rng.integers(0, vocab, size=(2, 3)).astype(np.int32)
        logits = jnp.asarray(rng.normal(size=(8, vocab)).astype(np.float32))
        q = jnp.asarray(rng.dirichlet(np.ones(vocab), size=(2, 3)).astype(np.float32))
        rs.verify_async(logits, rows, drafts, np.array([0, 4, 8], np.int32))
        rs.verify_async(logits, rows, drafts, np.array([0, 3, 5], np.int32), q)
    assert rs.compile_count() == before

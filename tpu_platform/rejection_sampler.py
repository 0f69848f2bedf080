"""Lossless draft verification on the device: greedy matching and rejection sampling.

One step verifies, for every sequence i, its n_i draft tokens d_0..d_{n-1} (``StepBatch``'s layout:
logits rows cu_logits[i] + j, j = 0..n_i, hold the target's logits after the sequence's last known
token and after each draft; drafts [S, K] with -1 pads). Shapes: R logits rows, S sequences,
K draft slots, V vocabulary.

Random rows (Leviathan et al. 2023; vLLM's ``rejection_sample``): with p_j the target distribution
at row j (the sampler's own temperature / min-p / top-k / top-p processing, ``sampler.target_logits``)
and q_j the draft distribution (one-hot at d_j when the drafter gives none, as n-gram does):
  * accept d_j when u_j * q_j(d_j) < p_j(d_j), u_j ~ U[0, 1), i.e. with probability min(1, p/q);
    a draft the drafter gave zero probability, or a -1 pad, is rejected;
  * at the first rejection emit a token drawn from normalize(max(p_j - q_j, 0)) and stop (one-hot q:
    p_j with d_j removed);
  * when all n drafts are accepted, emit a bonus token drawn from p_n.
Every emitted token is then distributed exactly as plain sampling from p would draw it.
Greedy rows (temperature < sampler.GREEDY_EPS) accept while the draft equals the argmax and emit the
argmax at the first mismatch (or the bonus row), as non-speculative greedy decoding would.

Randomness: row j of a sequence samples token index ``step + j`` (``SamplingBatch.steps`` of the
expanded rows). Its draw uses the plain sampler's key fold_in(key(seed), step + j), so a row with no
draft (the bonus row, a sequence with none) draws exactly what ``sampler.sample`` would; its accept
coin uses fold_in(key(seed), (step + j) | 2**31), a stream no draw touches (token indices stay below
2**31). A sequence's tokens depend only on its (seed, steps), never on the rest of the batch.

Compilation: one verify program per (R, S, K) and draft-probability presence, one greedy-acceptance
program per (R, S, K); ``RejectionSampler.warmup`` compiles them. Nothing in here syncs with the host.
A ``RejectionSampler`` is one engine's: it owns its programs and their trace count, and runs beside
that engine's ``Sampler``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.tpu_platform import sampler
from tpuserve.tpu_platform.device import place
from tpuserve.tpu_platform.sampler import Sampler
from tpuserve.tpu_platform.step_batch import SamplingBatch

# Or-ed into a token index to key its accept coin apart from its draw (see the module doc).
_COIN_STREAM = np.uint32(0x80000000)


@dataclass
class Verification:
    """A dispatched verification (device arrays).

    token_ids [S, K+1] i32: sequence i's new tokens are token_ids[i, :num_accepted[i] + 1]; -1 pads.
    num_accepted [S] i32. row_tokens [R] i32: the token chosen at each logits row (row cu_logits[i]
    + j holds token_ids[i, j] for j <= num_accepted[i]). logprobs: when asked, the raw-distribution
    logprobs of row_tokens per row (sampler.sample_async's parts), else None.
    """

    token_ids: jax.Array
    num_accepted: jax.Array
    row_tokens: jax.Array
    logprobs: tuple | None = None


def _row_layout(cu_logits: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """cu_logits [S+1] -> (seq [R] i32, pos [R] i32): which sequence a logits row belongs to and its
    index j within it. Rows past the last sequence map to the last slot (their values are unused)."""
    num_seqs = cu_logits.shape[0] - 1
    r = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_logits[1:], r, side="right").astype(jnp.int32)  # log2(S) steps
    seq = jnp.minimum(seq, num_seqs - 1)
    return seq, r - cu_logits[seq]


def _seq_rows(cu_logits: jax.Array, k: int, num_rows: int) -> jax.Array:
    """[S, K+1] i32: the logits row of (sequence i, position j), clipped into [0, R)."""
    j = jnp.arange(k + 1, dtype=jnp.int32)
    return jnp.clip(cu_logits[:-1, None] + j[None, :], 0, num_rows - 1)


def _finish(accept: jax.Array, row_tokens: jax.Array, rows: jax.Array, cu_logits: jax.Array):
    """Per-draft verdicts -> (token_ids [S, K+1], num_accepted [S]).

    accept [S, K] bool: draft j of sequence i is accepted; row_tokens [R]: the token each logits row
    emits; rows [S, K+1] from _seq_rows. A sequence keeps its drafts up to the first rejected one
    (or all it has), then the token of that row.
    """
    k = accept.shape[1]
    j = jnp.arange(k + 1, dtype=jnp.int32)
    n_drafts = cu_logits[1:] - cu_logits[:-1] - 1
    ok = accept & (j[None, :k] < n_drafts[:, None])
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    token_ids = jnp.where(j[None, :] <= num_accepted[:, None], row_tokens[rows], -1)
    return token_ids, num_accepted


def rejection_sample(
    y: jax.Array,
    greedy_ids: jax.Array,
    temperature: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    drafts: jax.Array,
    cu_logits: jax.Array,
    draft_probs: jax.Array | None = None,
    *,
    resample_from_target: bool = False,
):
    """The verification rule (traceable; see the module doc).

    y [R, V] f32: target logits after the sampler's processing (p = softmax(y)); greedy_ids [R] i32:
    the argmax greedy rows follow; temperature [R] f32 (greedy rows below sampler.GREEDY_EPS);
    seeds [R] u32, steps [R] i32: each row's key inputs; drafts [S, K] i32 (-1 pads);
    cu_logits [S+1] i32; draft_probs [S, K, V] f32 or None (one-hot drafts).
    resample_from_target: a deliberately wrong rule that resamples rejected rows from p instead of
    the residual; only the tests' negative control sets it.
    Returns (token_ids [S, K+1] i32, num_accepted [S] i32, row_tokens [R] i32).
    """
    num_rows, vocab = y.shape
    k = drafts.shape[1]
    if k == 0:
        raise ValueError("nothing to verify: drafts has no columns")
    seq, pos = _row_layout(cu_logits, num_rows)
    n_drafts = cu_logits[1:] - cu_logits[:-1] - 1
    # Each row's draft: the one it verifies, or -1 (bonus rows, padding).
    d = jnp.where(pos < n_drafts[seq], drafts[seq, jnp.clip(pos, 0, k - 1)], -1)
    has_draft = d >= 0
    d_safe = jnp.maximum(d, 0)[:, None]
    drafted = jax.nn.one_hot(d_safe[:, 0], vocab, dtype=bool) & has_draft[:, None]

    if draft_probs is None:
        # q is one-hot at d: p(d) from the logits, and the residual is p with d removed.
        p_d = jnp.exp(jnp.take_along_axis(y, d_safe, axis=1)[:, 0] - jax.nn.logsumexp(y, axis=1))
        q_d = jnp.ones_like(p_d)
        residual = jnp.where(drafted, -jnp.inf, y)
    else:
        p = jax.nn.softmax(y, axis=1)
        q = draft_probs.astype(jnp.float32)[seq, jnp.clip(pos, 0, k - 1)]  # [R, V]
        p_d = jnp.take_along_axis(p, d_safe, axis=1)[:, 0]
        q_d = jnp.take_along_axis(q, d_safe, axis=1)[:, 0]
        residual = jnp.log(jnp.maximum(p - q, 0.0))  # unnormalised logits: categorical normalises
    # p <= q everywhere leaves no residual mass; such a row is rejected only by rounding (p/q ~ 1),
    # and p is the distribution the rule tends to there.
    residual = jnp.where(jnp.all(residual == -jnp.inf, axis=1, keepdims=True), y, residual)
    if resample_from_target:
        residual = y

    keys = sampler.row_keys(seeds, steps)
    coin_keys = sampler.row_keys(seeds, (steps.astype(jnp.uint32) | _COIN_STREAM))
    u = jax.vmap(jax.random.uniform)(coin_keys)
    accept_random = has_draft & (q_d > 0) & (u * q_d < p_d)
    drawn = jax.vmap(jax.random.categorical)(keys, jnp.where(has_draft[:, None], residual, y))
    is_greedy = temperature < sampler.GREEDY_EPS
    accept = jnp.where(is_greedy, has_draft & (d == greedy_ids), accept_random)
    row_tokens = jnp.where(is_greedy, greedy_ids, jnp.where(accept, d, drawn.astype(jnp.int32))).astype(
        jnp.int32
    )
    rows = _seq_rows(cu_logits, k, num_rows)
    token_ids, num_accepted = _finish(accept[rows[:, :k]], row_tokens, rows, cu_logits)
    return token_ids, num_accepted, row_tokens


def _verify_impl(
    x: jax.Array,
    a: dict[str, jax.Array],
    drafts: jax.Array,
    cu_logits: jax.Array,
    draft_probs: jax.Array | None,
    resample_from_target: bool,
):
    """x [R, V] processed logits (after the extras stage) and the random stage's arguments ``a``
    (per row) -> rejection_sample's outputs."""
    x = x.astype(jnp.float32)
    greedy_ids = jnp.argmax(x, axis=-1).astype(jnp.int32)
    y = sampler.target_logits(x, a)
    return rejection_sample(
        y,
        greedy_ids,
        a["temperature"],
        a["seeds"],
        a["steps"],
        drafts,
        cu_logits,
        draft_probs,
        resample_from_target=resample_from_target,
    )


def accept_greedy(tokens: jax.Array, drafts: jax.Array, cu_logits: jax.Array):
    """Greedy verification. tokens [R] (the target's greedy token at each logits row), drafts [S, K]
    (-1 pads), cu_logits [S+1] -> (token_ids [S, K+1], num_accepted [S]).

    Drafts are accepted while they equal the target's token at their row; the new tokens are the
    target's tokens up to and including the first mismatch (or the bonus row after the last draft).
    """
    rows = _seq_rows(cu_logits, drafts.shape[1], tokens.shape[0])
    return _finish(drafts == tokens[rows[:, :-1]], tokens, rows, cu_logits)


class RejectionSampler:
    """One engine's verification programs, run beside its ``sampler`` (whose stages and neutral
    arrays they reuse); jitted per instance, so the trace count is this engine's own."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._traces = 0
        self._verify_jit = jax.jit(self._verify, static_argnames=("resample_from_target",))
        self._accept_greedy_jit = jax.jit(self._accept_greedy)

    def compile_count(self) -> int:
        """How many times a program of this rejection sampler was traced."""
        return self._traces

    # The traced bodies: Python runs them once per trace, never on cached calls.

    def _verify(self, x, a, drafts, cu_logits, draft_probs, resample_from_target: bool):
        self._traces += 1
        return _verify_impl(x, a, drafts, cu_logits, draft_probs, resample_from_target)

    def _accept_greedy(self, tokens, drafts, cu_logits):
        self._traces += 1
        return accept_greedy(tokens, drafts, cu_logits)

    def verify_async(
        self,
        logits: jax.Array,
        rows: SamplingBatch,
        draft_token_ids: Any,
        cu_logits: Any,
        draft_probs: jax.Array | None = None,
        *,
        max_logprobs: int = sampler.DEFAULT_MAX_LOGPROBS,
        resample_from_target: bool = False,
    ) -> Verification:
        """Verify one step's drafts (dispatches; never waits for the device).

        logits [R, V]: the raw target logits of the step's logits rows; rows: the sampling parameters
        expanded to one row per logits row (row j of a sequence with ``steps`` = its step + j);
        draft_token_ids [S, K] i32 (-1 pads); cu_logits [S+1] i32; draft_probs [S, K, V] or None
        (one-hot drafts). max_logprobs as for ``sampler.sample``.
        All-greedy batches take the sampler's own greedy path and ``accept_greedy``; a batch with a
        random row runs the rejection rule (its greedy rows follow the argmax all the same).
        """
        logits = jnp.asarray(logits)
        # Host arrays stay numpy (the jitted call ships them): a device-side cast would compile a program.
        drafts, cu = (
            a if isinstance(a, jax.Array) else np.asarray(a, np.int32) for a in (draft_token_ids, cu_logits)
        )
        if logits.ndim != 2 or drafts.ndim != 2 or cu.shape != (drafts.shape[0] + 1,):
            raise ValueError(
                f"bad shapes: logits {logits.shape}, drafts {drafts.shape}, cu_logits {cu.shape}"
            )
        if draft_probs is not None and draft_probs.shape != (*drafts.shape, logits.shape[1]):
            raise ValueError(
                f"draft_probs has shape {draft_probs.shape}, expected {(*drafts.shape, logits.shape[1])}"
            )
        if not bool((np.asarray(rows.temperature) >= sampler.GREEDY_EPS).any()):
            tokens, parts = self.sampler.sample_async(logits, rows, max_logprobs)
            token_ids, accepted = self._accept_greedy_jit(tokens, drafts, cu)
            return Verification(token_ids, accepted, tokens, parts)
        x, random_args, num_top = self.sampler.prepare_verification(logits, rows, max_logprobs)
        token_ids, accepted, row_tokens = self._verify_jit(
            x, random_args, drafts, cu, draft_probs, resample_from_target=resample_from_target
        )
        parts = None if num_top is None else self.sampler.token_logprobs_async(logits, row_tokens, num_top)
        return Verification(token_ids, accepted, row_tokens, parts)

    def warmup(
        self,
        shapes: Iterable[tuple[int, int, int]],
        vocab_size: int,
        *,
        draft_probs: bool = False,
    ) -> int:
        """Compile the verify and greedy-acceptance programs for each (R, S, K) in ``shapes`` (logits
        [R, V] f32), with one-hot drafts and, when ``draft_probs``, with draft distributions too.
        The sampler's own programs at R rows are ``Sampler.warmup``'s job. The warm-up logits live
        where the real ones do (the sampler's ``sharding``). Returns programs compiled."""
        sharding = self.sampler.sharding
        before = self.compile_count()
        for num_rows, num_seqs, k in sorted(set(shapes)):
            x = place(np.zeros((num_rows, vocab_size), np.float32), sharding)
            drafts = np.full((num_seqs, k), -1, np.int32)
            cu = np.zeros(num_seqs + 1, np.int32)
            rows = SamplingBatch.greedy(num_rows)
            self._accept_greedy_jit(place(np.zeros(num_rows, np.int32), sharding), drafts, cu)
            rows.temperature[0] = 1.0
            _, random_args, _ = self.sampler.prepare_verification(x, rows)
            for probs in (None, np.zeros((num_seqs, k, vocab_size), np.float32)) if draft_probs else (None,):
                self._verify_jit(x, random_args, drafts, cu, probs, resample_from_target=False)
        return self.compile_count() - before

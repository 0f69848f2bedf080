"""Typed host-side inputs and outputs of one model step: the contract between front ends and the runner.

Every front end (our scheduler, the vLLM worker, the SGLang worker) builds a ``StepBatch``; the
``ModelRunner`` never sees a request object. Arrays are numpy, already padded to the runner's shape
buckets (T token slots, S sequence slots, ``pages_per_seq`` page-table columns).
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SamplingBatch:
    """Per-sequence sampling parameters, one row per sequence slot (padding rows are greedy).

    temperature [S] f32 (0 = greedy), top_k [S] i32 (0 = off), top_p [S] f32 (1 = off),
    min_p [S] f32 (0 = off), seeds [S] u32 and steps [S] i32 (the PRNG key of a row is derived from
    (seed, step) alone, so a seeded request samples the same tokens whatever else is in the batch),
    repetition/presence/frequency penalties [S] f32 (1/0/0 = off).
    Optional dense inputs, present only when some row needs them:
      output_counts [S, V] i32   how often each token occurs in the row's output so far
      prompt_mask   [S, V] bool  which tokens occur in the row's prompt (repetition penalty)
      banned_ids    [S, K] i32   token ids forced to -inf (min_tokens holds back EOS/stop ids); -1 pads
      token_bitmask [S, ceil(V/32)] i32  allowed tokens (structured output, xgrammar's layout: bit j of
                    word w allows token 32*w + j); all-ones rows allow everything
    num_logprobs: None = no logprobs; k >= 0 = the sampled token's logprob plus the top k.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seeds: np.ndarray
    steps: np.ndarray
    repetition_penalty: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    output_counts: np.ndarray | None = None
    prompt_mask: np.ndarray | None = None
    banned_ids: np.ndarray | None = None
    token_bitmask: np.ndarray | None = None
    num_logprobs: int | None = None

    @classmethod
    def greedy(cls, num_rows: int) -> SamplingBatch:
        return cls(
            temperature=np.zeros(num_rows, np.float32),
            top_k=np.zeros(num_rows, np.int32),
            top_p=np.ones(num_rows, np.float32),
            min_p=np.zeros(num_rows, np.float32),
            seeds=np.zeros(num_rows, np.uint32),
            steps=np.zeros(num_rows, np.int32),
            repetition_penalty=np.ones(num_rows, np.float32),
            presence_penalty=np.zeros(num_rows, np.float32),
            frequency_penalty=np.zeros(num_rows, np.float32),
        )


@dataclass
class Logprobs:
    """Logprobs of chosen tokens under the model's raw distribution (log_softmax of the logits).

    token_logprobs [R] f32, token_ranks [R] i32 (1 = most likely), top_ids [R, k] i32,
    top_logprobs [R, k] f32.
    """

    token_logprobs: np.ndarray
    token_ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass
class SamplerOutput:
    """What the sampler returns for R logits rows: token_ids [R] i32 (+ logprobs of those tokens)."""

    token_ids: np.ndarray
    logprobs: Logprobs | None = None


@dataclass
class StepBatch:
    """One ragged step. T = len(token_ids), S = len(kv_lens), R = len(logits_indices).

    token_ids [T] i32, positions [T] i32: scheduled tokens of all sequences concatenated, then padding.
      A sequence's span is its known tokens, then its draft tokens (speculative decoding).
    cu_q_lens [S+1] i32, kv_lens [S] i32 (cache length after this step), page_table [S, pages_per_seq].
    logits_indices [R] i32: the token rows whose logits are computed; sequence i owns logits rows
      cu_logits[i]:cu_logits[i+1] (cu_logits [S+1] i32): the row of its last known token, then
      one per draft it verifies. A mid-prefill chunk has its one row too; the front end drops
      that sample.
    draft_token_ids [S, K] i32 (-1 pads; K = 0 when nothing is speculated): the drafts being verified.
    feed_rows [T] i32 or None (async scheduling): row r >= 0 takes its token id from the previous
      step's output of sequence slot feed_rows[r] (its last accepted token), on the device, because
      the host has not seen it yet; -1 keeps token_ids[r].
    prompt_logprob_rows: rows whose logprobs of ``prompt_logprob_targets`` (the next prompt token)
    are wanted, with ``num_prompt_logprobs`` top entries; None when no sequence asks for them.
    row_bitmask [R, ceil(V/32)] i32 or None: a grammar mask per logits row, when a sequence under a
      grammar verifies drafts (row j: the grammar's state after drafts 0..j-1); it replaces the
      per-sequence ``sampling.token_bitmask`` for that step.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    page_table: np.ndarray
    num_seqs: int
    num_tokens: int
    logits_indices: np.ndarray
    cu_logits: np.ndarray
    draft_token_ids: np.ndarray
    sampling: SamplingBatch
    feed_rows: np.ndarray | None = None
    prompt_logprob_rows: np.ndarray | None = None
    prompt_logprob_targets: np.ndarray | None = None
    num_prompt_logprobs: int = 0
    row_bitmask: np.ndarray | None = None

    @property
    def num_drafts(self) -> np.ndarray:
        """[S] i32: draft tokens each sequence verifies this step."""
        return (np.diff(self.cu_logits) - 1).clip(min=0).astype(np.int32)


@dataclass
class StepOutput:
    """What a step returns to its front end: rows 0..num_seqs-1 are real.

    token_ids [S, K+1] i32: sequence i's new tokens are token_ids[i, :num_accepted[i] + 1] (the
      accepted drafts, then the token sampled after them); -1 pads.
    num_accepted [S] i32: drafts accepted (0 when nothing was speculated).
    logprobs: per logits row (row cu_logits[i] + j holds the logprob of token_ids[i, j]);
      ``top_ids`` / ``top_logprobs`` carry max_logprobs columns: consumers slice each request's k.

    KV rollback: verifying k drafts writes K/V for all k of them. When only a < k are accepted the
    front end advances the sequence to ``num_computed + len(known tokens) + a``; the cache rows past
    that hold rejected drafts, lie beyond the sequence's kv_len from then on (so no attention reads
    them) and are overwritten by the next step's tokens. Nothing is copied or cleared on the device;
    a front end may free pages that now hold only rejected rows.
    """

    token_ids: np.ndarray
    num_accepted: np.ndarray
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None

    def new_tokens(self, i: int) -> list[int]:
        """Sequence i's tokens from this step, in order."""
        return [int(t) for t in self.token_ids[i, : int(self.num_accepted[i]) + 1]]


@dataclass
class SamplingRow:
    """One sequence's sampling state, as a front end knows it; ``SamplingBatch.from_rows`` packs them."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    step: int = 0  # tokens generated so far: the index of the token being sampled
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output_token_ids: list[int] | None = None  # needed only with penalties
    prompt_token_ids: list[int] | None = None  # needed only with a repetition penalty
    banned_ids: list[int] | None = None
    token_bitmask: np.ndarray | None = None  # [ceil(V/32)] i32, structured output
    num_logprobs: int | None = None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def sampling_row(
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    prompt_ids: list[int],
    output_ids: list[int],
    num_pending: int = 0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    min_tokens: int = 0,
    min_tokens_stop_ids: Collection[int] = (),
    token_bitmask: np.ndarray | None = None,
    num_logprobs: int | None = None,
) -> SamplingRow:
    """The one place a front end's request becomes a sampler row (engine, vLLM and SGLang alike).

    The row samples output token index ``len(output_ids) + num_pending`` (num_pending: tokens
    already sampled on the device that the caller has not seen). While fewer than ``min_tokens``
    are out, ``min_tokens_stop_ids`` (EOS and stop token ids) are banned. Penalties get the token
    history they need; rows without penalties carry none.
    """
    n_out = len(output_ids) + num_pending
    row = SamplingRow(
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        min_p=float(min_p),
        seed=int(seed) & 0xFFFFFFFF,
        step=n_out,
        repetition_penalty=float(repetition_penalty),
        presence_penalty=float(presence_penalty),
        frequency_penalty=float(frequency_penalty),
        token_bitmask=token_bitmask,
        num_logprobs=num_logprobs,
    )
    if row.has_penalties:
        if num_pending:
            raise ValueError("penalties need every output token on the host")
        row.output_token_ids, row.prompt_token_ids = list(output_ids), list(prompt_ids)
    if n_out < min_tokens and min_tokens_stop_ids:
        row.banned_ids = sorted(set(int(t) for t in min_tokens_stop_ids))
    return row


# The SamplingBatch columns pack_sampling_rows fills from the SamplingRow attributes of the same
# names (``step`` fills ``steps``), read in one C-level call per row.
_ROW_COLUMNS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "steps",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_PENALTY_COLUMNS = ("repetition_penalty", "presence_penalty", "frequency_penalty")
_row_values = operator.attrgetter(*(c if c != "steps" else "step" for c in _ROW_COLUMNS))


def pack_sampling_rows(rows: list[SamplingRow], num_slots: int, vocab_size: int) -> SamplingBatch:
    """Pack per-sequence rows into a SamplingBatch of ``num_slots`` rows (extra rows greedy padding).

    Dense [S, V] penalty inputs and the [S, K] ban list are built only when some row needs them.
    """
    b = SamplingBatch.greedy(num_slots)
    n = len(rows)
    # One table read per row and one fill per column, rather than nine scalar writes per row:
    # this runs for every sequence of every step. float64 holds each value exactly.
    penalties = banned = masks = False
    wanted: int | None = None
    if n:
        table = np.array([_row_values(r) for r in rows], np.float64)
        for j, name in enumerate(_ROW_COLUMNS):
            getattr(b, name)[:n] = table[:, j]
        b.seeds[:n] = np.fromiter((r.seed & 0xFFFFFFFF for r in rows), np.uint32, n)
        # SamplingRow.has_penalties over the table's (float64, exact) penalty columns.
        rep, pres, freq = (_ROW_COLUMNS.index(c) for c in _PENALTY_COLUMNS)
        penalties = bool(
            (table[:, rep] != 1.0).any() or (table[:, pres] != 0.0).any() or (table[:, freq] != 0.0).any()
        )
        # The optional inputs' flags in one pass over the rows.
        for r in rows:
            if r.banned_ids:
                banned = True
            if r.token_bitmask is not None:
                masks = True
            k = r.num_logprobs
            if k is not None and (wanted is None or k > wanted):
                wanted = k
    if penalties:
        b.output_counts = np.zeros((num_slots, vocab_size), np.int32)
        b.prompt_mask = np.zeros((num_slots, vocab_size), bool)
        for i, r in enumerate(rows):
            if r.has_penalties:
                np.add.at(b.output_counts[i], np.asarray(r.output_token_ids or [], np.int64), 1)
                b.prompt_mask[i, np.asarray(r.prompt_token_ids or [], np.int64)] = True
    if banned:
        width = 1 << max(len(r.banned_ids or []) for r in rows).bit_length()  # few distinct widths
        b.banned_ids = np.full((num_slots, width), -1, np.int32)
        for i, r in enumerate(rows):
            ids = r.banned_ids or []
            b.banned_ids[i, : len(ids)] = ids
    if masks:
        words = (vocab_size + 31) // 32
        b.token_bitmask = np.full((num_slots, words), -1, np.int32)
        for i, r in enumerate(rows):
            if r.token_bitmask is not None:
                b.token_bitmask[i] = r.token_bitmask
    b.num_logprobs = wanted
    return b


@dataclass
class ScheduledSeq:
    """One sequence's share of a step, before padding.

    token_ids: the tokens computed this step (a prefill chunk, or the one token of a decode);
    num_computed: tokens of this sequence already in the KV cache; page_ids: its page table,
    covering num_computed + len(token_ids) + len(draft_token_ids) tokens; prompt_logprob_targets:
    for the first len(targets) tokens of this chunk, the next prompt token whose logprob is wanted.
    draft_token_ids: proposed continuations to verify after token_ids (speculative decoding).
    feed_from: >= 0 when token_ids[0] is a placeholder for the token the previous (still running)
    step samples for its sequence slot ``feed_from``; the runner substitutes it on the device.
    draft_bitmasks [1 + len(draft_token_ids), ceil(V/32)] i32: under a grammar, the mask of each
    verification row (the state after the drafts before it); required when drafts meet a grammar.
    """

    token_ids: list[int]
    num_computed: int
    page_ids: list[int]
    sampling: SamplingRow
    prompt_logprob_targets: list[int] | None = None
    num_prompt_logprobs: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    feed_from: int = -1  # async scheduling: token_ids[0] is the previous step's output of this slot
    draft_bitmasks: np.ndarray | None = None

"""Typed host-side inputs and outputs of one model step: the contract between front ends and the runner.

Every front end (our scheduler, the vLLM worker, the SGLang worker) builds a ``StepBatch``; the
``ModelRunner`` never sees a request object. Arrays are numpy, already padded to the runner's shape
buckets (T token slots, S sequence slots, ``pages_per_seq`` page-table columns).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    def greedy(cls, num_rows: int) -> "SamplingBatch":
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
    token_ids: np.ndarray  # [S] i32
    logprobs: Logprobs | None = None


@dataclass
class StepBatch:
    """One ragged step. T = len(token_ids), S = len(kv_lens).

    token_ids [T] i32, positions [T] i32: scheduled tokens of all sequences concatenated, then padding.
    cu_q_lens [S+1] i32, kv_lens [S] i32 (cache length after this step), page_table [S, pages_per_seq].
    logits_indices [S] i32: row of each sequence's last scheduled token (its logits are sampled).
    prompt_logprob_rows: rows whose logprobs of ``prompt_logprob_targets`` (the next prompt token)
    are wanted, with ``num_prompt_logprobs`` top entries; None when no sequence asks for them.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    page_table: np.ndarray
    num_seqs: int
    num_tokens: int
    logits_indices: np.ndarray
    sampling: SamplingBatch
    prompt_logprob_rows: np.ndarray | None = None
    prompt_logprob_targets: np.ndarray | None = None
    num_prompt_logprobs: int = 0


@dataclass
class StepOutput:
    """What a step returns to its front end: rows 0..num_seqs-1 are real."""

    sampled: SamplerOutput
    prompt_logprobs: Logprobs | None = None

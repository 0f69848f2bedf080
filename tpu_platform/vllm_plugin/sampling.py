"""vLLM ``SamplingParams`` -> our per-sequence sampling settings, and which vLLM features we refuse.

A request's settings are converted once when it first reaches the worker (``SamplingSpec``); each step
only the moving parts (tokens generated so far, the grammar bitmask) are added to build the
``SamplingRow`` our sampler takes. Nothing here imports vLLM: params are read by attribute, so the
unit tests can pass stand-ins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tpuserve.tpu_platform.step_batch import SamplingRow, sampling_row


class UnsupportedRequest(ValueError):
    """A request asks for a sampling feature this platform does not implement."""


def unsupported_features(params: Any) -> list[str]:
    """Names of features in ``params`` (a vLLM SamplingParams) that we cannot honour.

    Checked in the front end (Platform.validate_request) so the client gets a clear 400, and again
    in the worker as a guard.
    """
    out = []
    if getattr(params, "logit_bias", None):
        out.append("logit_bias")
    if getattr(params, "bad_words", None):
        out.append("bad_words")
    if getattr(params, "logprob_token_ids", None):
        out.append("logprob_token_ids")
    if getattr(params, "prompt_logprob_start", None) not in (None, 0):
        out.append("prompt_logprob_start")
    if getattr(params, "thinking_token_budget", None) is not None:
        out.append("thinking_token_budget")
    if getattr(params, "watermarking", None):
        out.append("watermarking")
    if getattr(params, "trace_decode_token_ids", None):
        out.append("trace_decode_token_ids")
    return out


def allowed_ids_bitmask(allowed: list[int], vocab_size: int) -> np.ndarray:
    """allowed_token_ids -> [ceil(V/32)] i32 bitmask in xgrammar's layout (bit j of word w: token 32w+j)."""
    ids = np.asarray(sorted(set(allowed)), np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise UnsupportedRequest(f"allowed_token_ids must lie in [0, {vocab_size})")
    words = np.zeros((vocab_size + 31) // 32, np.uint32)
    np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


@dataclass(frozen=True)
class SamplingSpec:
    """One request's fixed sampling settings, already in our conventions."""

    temperature: float
    top_k: int  # 0 = off (vLLM's 0 and -1 both mean off)
    top_p: float
    min_p: float
    seed: int  # vLLM's seed, or one drawn by the worker for unseeded requests
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    stop_token_ids: tuple[int, ...]  # held back while fewer than min_tokens were generated
    num_logprobs: int | None  # top-k beside the sampled token; None = none wanted
    num_prompt_logprobs: int | None
    allowed_mask: np.ndarray | None = None  # [ceil(V/32)] i32 from allowed_token_ids
    uses_grammar: bool = False  # structured output: vLLM sends a bitmask row each step

    @property
    def drafts_verifiable(self) -> bool:
        """Whether our runner can verify drafts for this request: not under a token mask, which
        would need the mask of the state after each draft."""
        return not self.uses_grammar and self.allowed_mask is None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_vllm(cls, params: Any, vocab_size: int, fallback_seed: int) -> SamplingSpec:
        bad = unsupported_features(params)
        if bad:
            raise UnsupportedRequest(f"not supported on the tpuserve platform: {', '.join(bad)}")

        def count(k: int | None) -> int | None:
            # vLLM's -1 means "the whole vocabulary".
            return None if k is None else (vocab_size if k < 0 else int(k))

        allowed = getattr(params, "allowed_token_ids", None)
        return cls(
            temperature=float(params.temperature),
            top_k=max(int(params.top_k or 0), 0),
            top_p=float(params.top_p),
            min_p=float(params.min_p),
            seed=int(params.seed) if params.seed is not None else int(fallback_seed),
            repetition_penalty=float(params.repetition_penalty),
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            min_tokens=int(params.min_tokens or 0),
            stop_token_ids=tuple(sorted(getattr(params, "all_stop_token_ids", None) or ())),
            num_logprobs=count(params.logprobs),
            num_prompt_logprobs=count(params.prompt_logprobs),
            allowed_mask=allowed_ids_bitmask(allowed, vocab_size) if allowed else None,
            uses_grammar=getattr(params, "structured_outputs", None) is not None,
        )

    def row(
        self, prompt_ids: list[int], output_ids: list[int], grammar_mask: np.ndarray | None
    ) -> SamplingRow:
        """The sampler's row for the token at output index ``len(output_ids)``."""
        mask = self.allowed_mask
        if grammar_mask is not None:
            mask = grammar_mask if mask is None else (mask & grammar_mask)
        return sampling_row(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens,
            min_tokens_stop_ids=self.stop_token_ids,
            token_bitmask=mask,
            num_logprobs=self.num_logprobs,
        )

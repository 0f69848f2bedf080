"""A sequence's lifecycle state inside the standalone engine (one per sampled completion)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tpuserve.server.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One completion. A request with n > 1 owns n sequences that share the prompt.

    ``num_computed`` counts tokens whose KV is in the cache (or being written by a dispatched step);
    tokens = prompt + output + pending (sampled on the device, not yet seen by the host).
    """

    seq_id: str
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    # Async scheduling: tokens sampled by a dispatched step that the host has not seen yet, and
    # the sequence slot they occupy in that step's output (where the next step feeds them from).
    num_pending: int = 0
    feed_slot: int = -1
    page_ids: list[int] = field(default_factory=list)
    # Disaggregated prefill: a prefill engine's pages for this prompt (a ``PageBatch``), used once
    # at admission instead of computing the prompt.
    remote_kv: Any = None
    # Speculative decoding: the drafts proposed for this sequence's next step; with a draft head,
    # where its drafting resumes (a DraftSeed) and the num_computed that seed belongs to.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_seed: Any = None
    draft_seed_at: int = -1
    # Prefix cache: the request's salt, hashes of the full pages of the known tokens, how many of
    # page_ids are registered in the cache, and the prompt tokens found cached at first admission.
    cache_salt: str | None = None
    page_hashes: list[bytes] = field(default_factory=list)
    num_registered_pages: int = 0
    num_cached_tokens: int = 0
    admitted: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Filled by the engine: text state, logprobs, grammar matcher.
    detok: Any = None
    stopper: Any = None
    text: str = ""
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list | None = None
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def num_known(self) -> int:
        """Tokens the host has seen (all but the pending ones)."""
        return self.num_tokens - self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

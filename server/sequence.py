"""A request's lifecycle state inside the standalone engine: the request and its sequences (one per
sampled completion)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tpuserve.server.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tpuserve.server.outputs import PositionLogprobs
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.spec_decode.coordinator import DraftFacts
from tpuserve.tpu_platform.step_batch import SamplingRow

if TYPE_CHECKING:
    from tpuserve.kv_cache.transfer.transport import PageBatch


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class GrammarMatcher(Protocol):
    """A sequence's structured-output matcher (``LLMEngine(grammar_factory=...)`` builds one)."""

    def fill_bitmask(self) -> np.ndarray:
        """int32[ceil(V/32)]: the tokens allowed next (bit i % 32 of word i // 32: token i)."""
        ...

    def accept(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...


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
    # Async scheduling: tokens sampled by a dispatched step that the host has not seen yet.
    num_pending: int = 0
    page_ids: list[int] = field(default_factory=list)
    # Disaggregated prefill: a prefill engine's pages for this prompt, used once at admission
    # instead of computing the prompt.
    remote_kv: PageBatch | None = None
    # Prefix cache: the request's salt, hashes of the full pages of the known tokens, how many of
    # page_ids are registered in the cache, and the prompt tokens found cached at first admission.
    cache_salt: str | None = None
    page_hashes: list[bytes] = field(default_factory=list)
    num_registered_pages: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Filled by the engine's output processor (text so far, cut at stops; per-token logprobs when
    # asked for) and, under structured outputs, the grammar matcher.
    detok: IncrementalDetokenizer | None = None
    stopper: StopStringMatcher | None = None
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    grammar: GrammarMatcher | None = None
    # The engine's sampler row for plain decode steps (no grammar mask, penalties or banned
    # stops): only its ``step`` changes from one step to the next, so it is built once.
    plain_row: SamplingRow | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two lists (a decode step
        asks for one token of a long sequence)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_known(self) -> int:
        """Tokens the host has seen (all but the pending ones)."""
        return self.num_tokens - self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def cumulative_logprob(self) -> float:
        """The sum of the chosen tokens' logprobs (0 when logprobs are not kept)."""
        total = 0.0
        for token, position in zip(self.output_token_ids, self.logprobs or ()):
            total += position[token].logprob  # in order, as the tokens came: the same float sum
        return total

    @property
    def draft_facts(self) -> DraftFacts:
        """What speculative decoding's rule reads of this sequence (spec_decode/coordinator.py)."""
        p = self.params
        n_out = len(self.output_token_ids)
        return DraftFacts(
            num_output_tokens=n_out,
            min_tokens=p.min_tokens,
            token_mask=self.grammar is not None,
            logprobs=p.logprobs is not None,
            penalties=p.has_penalties,
            tokens_left=None if p.max_tokens is None else p.max_tokens - n_out,
        )

    def can_feed_from_device(self, max_model_len: int) -> bool:
        """Whether the next step may take this sequence while its last token is still on the device
        (always, when the host has every token).

        Such a step can only decode that token, fed on the device, and only when its sampling needs
        no host view of it (grammar, penalties) and it cannot have finished by length."""
        if not self.num_pending:
            return True
        p = self.params
        # A plain row exists only for params without penalties.
        if self.grammar is not None or (self.plain_row is None and p.has_penalties):
            return False
        n_out = len(self.output_token_ids) + self.num_pending
        num_tokens = len(self.prompt_token_ids) + n_out
        if num_tokens - self.num_computed != 1:
            return False  # preempted: recomputing needs every token on the host
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return False
        return num_tokens < max_model_len


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival: float
    error: str | None = None
    error_status: int = 500
    first_token_time: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    export_kv: bool = False  # a prefill for a remote decode: offer its pages when it finishes
    kv_transfer_params: dict | None = None  # what the consumer pulls them with

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.status is not SeqStatus.FINISHED:
                return False
        return True

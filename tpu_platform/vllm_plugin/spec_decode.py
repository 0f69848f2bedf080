"""vLLM's speculative decoding contract, served by our runner's draft verification (n-gram only).

How vLLM 0.32 drives a worker that speculates (``gpu_model_runner.py``, ``core/sched/scheduler.py``):
  * after each step the engine core calls ``take_draft_token_ids()``; the drafts it returns
    (``DraftTokenIds``: request ids and a token list each) become the requests' ``spec_token_ids``;
  * the next ``SchedulerOutput`` schedules ``1 + len(drafts)`` tokens for such a request and lists
    the drafts in ``scheduled_spec_decode_tokens`` (``-1`` entries are padding, never real drafts);
  * the worker returns, per request, the accepted drafts followed by one sampled token in
    ``ModelRunnerOutput.sampled_token_ids``; the scheduler rolls ``num_computed_tokens`` back by the
    rejected count and files vLLM's spec-decode metrics (drafts, draft tokens, accepted, per position).

So the worker may verify any prefix of the scheduled drafts (an empty one included): what it does not
verify counts as rejected. Our ``RequestTable`` plans the verification (``request_state.py``); this
module holds the settings, the platform's refusals, and the host-side proposer (``spec_decode.ngram``,
vLLM's rule, checked against vLLM's own in tests/vllm_plugin/test_ngram_oracle.py).

Nothing here imports vLLM or JAX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tpuserve.spec_decode import coordinator
from tpuserve.spec_decode.coordinator import DraftFacts, DraftSupport
from tpuserve.spec_decode.ngram import NgramProposer

SUPPORTED_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # EngineConfig's bound (and the draft slots the runner compiles)


def unsupported_speculative(sc: Any) -> list[str]:
    """Why vLLM's ``speculative_config`` cannot run on our worker (empty: it can)."""
    if sc is None:
        return []
    method = getattr(sc, "method", None)
    if method not in SUPPORTED_METHODS:
        return [
            f"--speculative-config method={method!r} (the tpuserve platform speculates with "
            f"'ngram' only; EAGLE-3 / MTP draft heads are not wired through the plugin)"
        ]
    out = []
    k = int(getattr(sc, "num_speculative_tokens", 0) or 0)
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        out.append(
            f"--speculative-config num_speculative_tokens={k} (must be in "
            f"[1, {MAX_SPECULATIVE_TOKENS}] on the tpuserve platform)"
        )
    if getattr(sc, "num_speculative_tokens_per_batch_size", None):
        out.append(
            "--speculative-config num_speculative_tokens_per_batch_size (dynamic draft "
            "lengths are not supported on the tpuserve platform)"
        )
    rsm = getattr(sc, "rejection_sample_method", "standard")
    if rsm != "standard":
        out.append(
            f"--speculative-config rejection_sample_method={rsm!r} (the tpuserve platform "
            f"verifies drafts with the standard lossless rule)"
        )
    if getattr(sc, "parallel_drafting", False):
        out.append("--speculative-config parallel_drafting (not supported on the tpuserve platform)")
    return out


@dataclass(frozen=True)
class NgramSettings:
    """The n-gram speculation vLLM asked for, its lookup range already resolved by vLLM."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> NgramSettings | None:
        sc = vllm_config.speculative_config
        if sc is None:
            return None
        bad = unsupported_speculative(sc)
        if bad:  # the platform refused it already; a guard for direct use
            raise ValueError("; ".join(bad))
        return cls(int(sc.num_speculative_tokens), int(sc.prompt_lookup_min), int(sc.prompt_lookup_max))

    def engine_section(self) -> dict[str, Any]:
        """Our EngineConfig's ``speculative_config``: the runner sizes (and warms) its draft slots by it."""
        return {
            "method": "ngram",
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
        }


@dataclass(frozen=True)
class Drafts:
    """Drafts for the next step, as vLLM's ``DraftTokenIds`` carries them."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]


class DraftPlanner:
    """Proposes the next step's drafts for the requests a step just sampled."""

    def __init__(self, settings: NgramSettings, max_model_len: int):
        self.proposer = NgramProposer.create(
            settings.num_speculative_tokens,
            max_model_len,
            settings.prompt_lookup_min,
            settings.prompt_lookup_max,
        )

    def propose(self, table: Any, sampled_req_ids: list[str]) -> Drafts:
        """An entry per request that sampled this step (empty where it should not draft), so the
        scheduler's view of every one is refreshed."""
        lists: list[list[int]] = []
        for rid in sampled_req_ids:
            st = table.requests[rid]
            if not may_draft(st):
                lists.append([])
                continue
            lists.append([int(t) for t in self.proposer.propose(np.asarray(st.token_ids, np.int64))])
        return Drafts(list(sampled_req_ids), lists)


# This worker takes one mask row per request from vLLM (worker._grammar_masks), so a request under a
# grammar or allowed-token mask does not draft; it returns logprob rows per verified position, and
# the runner counts drafts into the penalties, so those requests do.
PLUGIN_DRAFT_SUPPORT = DraftSupport(token_masks=False, logprobs=True, penalties=True)


def may_draft(st: Any) -> bool:
    """Whether drafts for this request (a ``RequestTable`` entry) verify to what plain decoding
    would give: the engine's rule (spec_decode/coordinator.py), under this worker's support."""
    spec = st.spec
    facts = DraftFacts(
        num_output_tokens=len(st.output_ids),
        min_tokens=spec.min_tokens,
        token_mask=not spec.drafts_verifiable,
        logprobs=spec.num_logprobs is not None,
        penalties=spec.has_penalties,
    )
    return coordinator.may_draft(facts, PLUGIN_DRAFT_SUPPORT)

"""The worker's persistent per-request state, and the translation of one vLLM step into ours.

vLLM's scheduler sends only deltas: a request's prompt, sampling params and first block ids once
(``scheduled_new_reqs``), then per step just its new block ids and how many tokens it has computed
(``scheduled_cached_reqs``). The tokens this worker sampled are not sent back (outside pipeline
parallelism), so the worker appends them to its own copy. ``RequestTable`` holds that copy and turns
each ``SchedulerOutput`` into our ``ScheduledSeq`` list (``StepPlan``); after the model step,
``StepPlan.finish`` folds the sampled tokens back in.

vLLM features expressed through this table:
  * chunked prefill: a request's chunk is ``token_ids[num_computed : num_computed + n]``; a step that
    does not reach the end of what is known samples nothing for it (the token is dropped);
  * prefix caching: a new request arrives with ``num_computed_tokens > 0`` and block ids whose first
    pages already hold that prefix's KV, so the chunk simply starts later;
  * preemption (recompute): the request comes back with ``resumed`` set, fresh block ids replacing
    the old ones and (model runner V1) its full token list, and recomputes from num_computed;
  * speculative decoding: a decode may carry drafts (``scheduled_spec_decode_tokens``, counted in
    its scheduled tokens); they are verified after its last known token, and the accepted drafts
    plus the token sampled after them come back as that request's sampled tokens (see
    spec_decode.py for the contract).

Nothing here imports vLLM or JAX: the scheduler's objects are read by attribute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tpuserve.tpu_platform.step_batch import Logprobs, ScheduledSeq, StepOutput
from tpuserve.tpu_platform.vllm_plugin.sampling import SamplingSpec


@dataclass
class PromptLogprobBuffer:
    """Prompt logprobs filled chunk by chunk; vLLM receives them once, when the prefill ends.

    Row p holds the logprob of prompt token p+1 given tokens 0..p: column 0 the actual token,
    then the top k.
    """

    token_ids: np.ndarray  # [P-1, k+1] i32
    logprobs: np.ndarray  # [P-1, k+1] f32
    ranks: np.ndarray  # [P-1] i32

    @classmethod
    def empty(cls, num_prompt_tokens: int, k: int) -> PromptLogprobBuffer:
        rows = max(num_prompt_tokens - 1, 0)
        return cls(
            np.zeros((rows, k + 1), np.int32), np.zeros((rows, k + 1), np.float32), np.zeros(rows, np.int32)
        )


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt, then every output token this worker knows of
    num_prompt_tokens: int
    block_ids: list[int]
    spec: SamplingSpec
    num_computed_tokens: int = 0
    prompt_logprobs: PromptLogprobBuffer | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class PlannedSeq:
    """One request's share of a step, before the grammar bitmask is known."""

    req_id: str
    num_computed: int
    token_ids: list[int]
    page_ids: list[int]
    samples: bool  # this step reaches the end of the known tokens, so its sampled token is kept
    prompt_logprob_targets: list[int] | None = None
    # Drafts verified after token_ids (a prefix of what vLLM scheduled; the rest counts as rejected).
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepResult:
    """What vLLM's ModelRunnerOutput needs, in plain Python / numpy."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # LogprobsLists columns: [sampled, top-1, ..., top-k]; one row per request (row i = req_ids[i]).
    logprob_token_ids: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    sampled_ranks: np.ndarray | None = None
    prompt_logprobs: dict[str, PromptLogprobBuffer] = field(default_factory=dict)
    # With drafts, each request's logprob rows start at cu_num_generated_tokens[i] (vLLM's
    # LogprobsLists slicing); None: one row per request.
    cu_num_generated_tokens: list[int] | None = None


@dataclass
class StepPlan:
    seqs: list[PlannedSeq]
    # Drafts vLLM scheduled per request, -1 padding included: its grammar bitmask has 1 + that many
    # rows for each structured-output request.
    scheduled_drafts: dict[str, int] = field(default_factory=dict)

    def scheduled(
        self, table: RequestTable, grammar_masks: dict[str, np.ndarray] | None = None
    ) -> list[ScheduledSeq]:
        """Our runner's input: the planned chunks with this step's sampling rows."""
        out = []
        for p in self.seqs:
            st = table.requests[p.req_id]
            mask = grammar_masks.get(p.req_id) if grammar_masks else None
            row = st.spec.row(st.prompt_ids, st.output_ids, mask)
            k = st.spec.num_prompt_logprobs
            out.append(
                ScheduledSeq(
                    token_ids=p.token_ids,
                    num_computed=p.num_computed,
                    page_ids=p.page_ids,
                    sampling=row,
                    prompt_logprob_targets=p.prompt_logprob_targets,
                    num_prompt_logprobs=k if (p.prompt_logprob_targets and k) else 0,
                    draft_token_ids=list(p.draft_token_ids),
                )
            )
        return out

    def finish(self, table: RequestTable, output: StepOutput) -> StepResult:
        """Fold the step's sampled tokens into the table; build the output vLLM expects."""
        tokens = np.asarray(output.token_ids)
        accepted = np.asarray(output.num_accepted)
        result = StepResult(req_ids=[p.req_id for p in self.seqs], sampled_token_ids=[])
        # Logits rows: 1 + drafts per sequence, in order; row cu[i] + j scored token j of sequence i.
        cu = np.concatenate([[0], np.cumsum([1 + len(p.draft_token_ids) for p in self.seqs])]).astype(
            np.int64
        )
        row_tokens = np.zeros(int(cu[-1]), np.int32)
        pl_offset = 0
        for i, p in enumerate(self.seqs):
            st = table.requests[p.req_id]
            st.num_computed_tokens = p.num_computed + len(p.token_ids)
            n_rows = 1 + len(p.draft_token_ids)
            row_tokens[cu[i] : cu[i + 1]] = np.maximum(tokens[i, :n_rows], 0)
            if p.samples:
                a = int(accepted[i])
                new = [int(t) for t in tokens[i, : a + 1]]
                st.token_ids.extend(new)
                st.num_computed_tokens += a  # the accepted drafts' KV was written this step
                result.sampled_token_ids.append(new)
            else:
                result.sampled_token_ids.append([])  # mid-prefill chunk: vLLM expects no token
            if p.prompt_logprob_targets is not None:
                n = len(p.prompt_logprob_targets)
                if n:
                    _fill_prompt_logprobs(st, p.num_computed, output.prompt_logprobs, pl_offset, n)
                    pl_offset += n
                if st.num_computed_tokens >= st.num_prompt_tokens and st.prompt_logprobs is not None:
                    result.prompt_logprobs[p.req_id] = st.prompt_logprobs
                    st.prompt_logprobs = None  # delivered once; a recompute after preemption skips them
        lp = output.logprobs
        if lp is not None:
            rows = int(cu[-1])
            # The step computed max_logprobs columns; vLLM gets the most any request here asked for.
            wanted = [table.requests[p.req_id].spec.num_logprobs for p in self.seqs]
            k = max((w for w in wanted if w is not None), default=0)
            if rows != len(self.seqs):
                result.cu_num_generated_tokens = [int(c) for c in cu]
            result.logprob_token_ids = np.concatenate(
                [row_tokens[:, None], np.asarray(lp.top_ids)[:rows, :k]], axis=1
            )
            result.logprobs = np.concatenate(
                [np.asarray(lp.token_logprobs)[:rows, None], np.asarray(lp.top_logprobs)[:rows, :k]], axis=1
            ).astype(np.float32)
            result.sampled_ranks = np.asarray(lp.token_ranks)[:rows].astype(np.int32)
        return result


def _verifiable_drafts(st: RequestState, scheduled: list[int]) -> list[int]:
    """The drafts this worker verifies: those before the first -1 (vLLM's padding), none for a
    request whose drafts our runner cannot verify (a token mask). What is left out is rejected."""
    if not scheduled or not st.spec.drafts_verifiable:
        return []
    cut = next((i for i, t in enumerate(scheduled) if t < 0), len(scheduled))
    return [int(t) for t in scheduled[:cut]]


def _fill_prompt_logprobs(st: RequestState, start: int, lp: Logprobs | None, offset: int, n: int) -> None:
    buf = st.prompt_logprobs
    if buf is None or lp is None:
        return
    k = buf.token_ids.shape[1] - 1
    rows = slice(offset, offset + n)
    dst = slice(start, start + n)
    buf.token_ids[dst, 0] = st.token_ids[start + 1 : start + 1 + n]
    buf.logprobs[dst, 0] = np.asarray(lp.token_logprobs)[rows]
    buf.ranks[dst] = np.asarray(lp.token_ranks)[rows]
    if k:
        buf.token_ids[dst, 1:] = np.asarray(lp.top_ids)[rows, :k]
        buf.logprobs[dst, 1:] = np.asarray(lp.top_logprobs)[rows, :k]


class RequestTable:
    """Per-request state that lives across steps, keyed by vLLM's request id."""

    def __init__(self, block_size: int, vocab_size: int, seed: int = 0):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.requests: dict[str, RequestState] = {}
        # Seeds for requests that bring none; drawn in arrival order from the engine's seed.
        self._seed_rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.requests)

    def plan(self, so: Any) -> StepPlan:
        """Apply one SchedulerOutput's deltas and plan the step it schedules."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        # preempted_req_ids needs no action: a preempted request keeps its tokens here, and when it
        # is scheduled again it comes back either as a resumed cached request with fresh blocks
        # (model runner V1) or as a new request carrying all its tokens (V2), which replaces it.
        for new in so.scheduled_new_reqs:
            self._add(new)
        self._update_cached(so.scheduled_cached_reqs)
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}

        seqs = []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.requests[req_id]
            scheduled_drafts = list(spec.get(req_id, ()))
            n -= len(scheduled_drafts)  # vLLM counts the drafts among the scheduled tokens
            start = st.num_computed_tokens
            end = start + n
            if end > len(st.token_ids):
                raise RuntimeError(
                    f"request {req_id}: {n} tokens scheduled from {start}, but only "
                    f"{len(st.token_ids)} are known to the worker"
                )
            drafts = _verifiable_drafts(st, scheduled_drafts)
            if drafts and end != len(st.token_ids):
                raise RuntimeError(
                    f"request {req_id}: drafts scheduled after token {end}, but the "
                    f"worker knows {len(st.token_ids)} tokens"
                )
            pages = math.ceil((end + len(drafts)) / self.block_size)
            if pages > len(st.block_ids):
                raise RuntimeError(
                    f"request {req_id}: {len(st.block_ids)} blocks cannot hold {end + len(drafts)} tokens"
                )
            targets = None
            if st.prompt_logprobs is not None:
                # Row p of the chunk wants the logprob of token p+1, while p+1 is still in the prompt.
                last = min(end, st.num_prompt_tokens - 1)
                targets = st.token_ids[start + 1 : last + 1] if last > start else []
            seqs.append(
                PlannedSeq(
                    req_id=req_id,
                    num_computed=start,
                    token_ids=st.token_ids[start:end],
                    page_ids=st.block_ids[:pages],
                    samples=end >= len(st.token_ids),
                    prompt_logprob_targets=targets,
                    draft_token_ids=drafts,
                )
            )
        return StepPlan(seqs, {rid: len(d) for rid, d in spec.items() if d})

    def _add(self, new: Any) -> None:
        if new.prompt_token_ids is None:
            raise NotImplementedError("prompt embeddings are not supported on the tpuserve platform")
        if getattr(new, "pooling_params", None) is not None:
            raise NotImplementedError("pooling requests are not supported on the tpuserve platform")
        if getattr(new, "lora_request", None) is not None:
            raise NotImplementedError("LoRA is not supported on the tpuserve platform")
        spec = SamplingSpec.from_vllm(
            new.sampling_params, self.vocab_size, int(self._seed_rng.integers(0, 2**32))
        )
        # V2 model runner resends a preempted request with its prompt + outputs so far as prefill.
        tokens = list(getattr(new, "prefill_token_ids", None) or new.prompt_token_ids)
        num_prompt = len(new.prompt_token_ids)
        self.requests[new.req_id] = RequestState(
            req_id=new.req_id,
            token_ids=tokens,
            num_prompt_tokens=num_prompt,
            block_ids=list(new.block_ids[0]),
            spec=spec,
            num_computed_tokens=int(new.num_computed_tokens),
            prompt_logprobs=(
                PromptLogprobBuffer.empty(num_prompt, spec.num_prompt_logprobs)
                if spec.num_prompt_logprobs is not None
                else None
            ),
        )

    def _update_cached(self, cached: Any) -> None:
        resumed = cached.resumed_req_ids
        all_tokens = getattr(cached, "all_token_ids", None) or {}
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests[req_id]
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:
                # Preempted, now back: its old pages were freed; these replace them.
                st.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                st.block_ids.extend(new_blocks[0])
            st.num_computed_tokens = int(cached.num_computed_tokens[i])
            if req_id in all_tokens:
                # Sent for requests not scheduled in the previous step: the scheduler's full token
                # list, authoritative over ours.
                st.token_ids = list(all_tokens[req_id])

"""The standalone engine: request lifecycle around the scheduler and the model runner.

``add_request`` validates and queues; ``step`` schedules, runs one ragged model step, and turns sampled
ids into text, logprobs and finish decisions; ``abort_request`` frees a request's pages at once. A
request that fails on its own (bad grammar, ...) finishes with an error; the others go on.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tpuserve.kv_cache.block_pool import BlockPool
from tpuserve.server.detokenizer import IncrementalDetokenizer, StopStringMatcher, decode_token
from tpuserve.server.outputs import CompletionOutput, Logprob, RequestOutput
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.server.scheduler import ScheduledWork, Scheduler, SchedulerOutput
from tpuserve.server.sequence import Sequence
from tpuserve.spec_decode.ngram import propose_ngram
from tpuserve.tpu_platform.config import EngineConfig
from tpuserve.tpu_platform.draft_runner import CatchUpSeq
from tpuserve.tpu_platform.model_runner import PendingStep
from tpuserve.tpu_platform.step_batch import Logprobs, ScheduledSeq, StepOutput, sampling_row
from tpuserve.tpu_platform.worker import Worker

log = logging.getLogger(__name__)


class GrammarDeadEndError(ValueError):
    """A request's grammar admits no token where decoding stands (it matches no complete text)."""


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found cached (device or host)
    host_cache_queries: int = 0  # tokens looked up in the host tier after a device miss
    host_cache_hits: int = 0
    host_bytes_loaded: int = 0
    host_bytes_saved: int = 0
    steps: int = 0
    # Speculative decoding, as vLLM counts it: steps that verified drafts, drafts, accepted drafts,
    # and accepted drafts by position (index j: the (j+1)-th draft of a step was accepted).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


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
    prompt_logprobs: list | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    export_kv: bool = False  # a prefill for a remote decode: offer its pages when it finishes
    kv_transfer_params: dict | None = None  # what the consumer pulls them with

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class _InFlight:
    """A dispatched step: the work it covers (with where each chunk started) and its device results."""

    work: list[ScheduledWork]
    starts: list[int]  # num_computed of each sequence when the step was dispatched
    completes: list[bool]  # the chunk reaches the sequence's last token: its sample is kept
    prompt_rows: list[int]  # first prompt-logprob row of each item in the step's output
    step: PendingStep
    num_drafts: list[int] = field(default_factory=list)  # drafts each item verifies
    features: Any = None  # the step's draft-head features [T, A] on the device (EAGLE-3 / MTP)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        grammar_factory: Callable[[Any, Any, int], Any] | None = None,
        replica: int = 0,
    ):
        """``grammar_factory(structured_output_params, tokenizer, vocab_size)`` builds a matcher with
        ``fill_bitmask() -> int32[ceil(V/32)]``, ``accept(token_id) -> bool``, ``is_terminated()``.
        ``replica``: which data-parallel replica (device subset) this engine runs on."""
        from tpuserve.tpu_platform.device import discover

        config = config.for_backend(discover().backend)  # the platform's scheduler sizes
        self.config = config
        self.worker = Worker(config, replica)
        self.worker.load()
        self.device, self.dtype = self.worker.device, self.worker.dtype
        self.arch, self.tokenizer = self.worker.arch, self.worker.tokenizer
        self.model_source, self.max_model_len = self.worker.model_source, self.worker.max_model_len
        num_pages = self.worker.num_pages()
        self.runner = self.worker.init_kv_cache(num_pages)
        cache = config.cache
        self.host_tier = self._build_host_tier(cache.kv_offloading_size)
        self.pool = BlockPool(
            num_pages,
            cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            record_evictions=self.host_tier is not None,
        )
        sched = config.scheduler
        self.scheduler = Scheduler(
            self.pool,
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
            sched.enable_chunked_prefill,
            can_schedule=self._can_schedule,
            host_tier=self.host_tier,
        )
        self.speculative = config.speculative
        # Drafts are proposed from the tokens the host has seen, so a drafting sequence needs its
        # last token on the host: with speculation the engine schedules synchronously.
        self.async_scheduling = sched.async_scheduling and self.speculative is None
        # drafter(token_ids [N], k) -> up to k draft ids (tests swap in replaying / adversarial ones).
        self.drafter: Callable[[np.ndarray, int], list[int]] = self._ngram_drafter
        # EAGLE-3 / MTP: the draft head beside the runner (None for n-gram).
        self.draft_runner = self.worker.draft_runner
        self.grammar_factory = grammar_factory
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        if self.speculative is not None:
            self.stats.spec_accepted_per_pos = [0] * self.speculative.num_speculative_tokens
        self.eos_token_ids = set(self.arch.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._seed_rng = np.random.default_rng(config.model.seed)
        self._ids = itertools.count()
        self._inflight: _InFlight | None = None
        self.kv_role = None
        if config.kv_transfer is not None:
            from tpuserve.server.kv_transfer import KVTransferRole

            model_id = config.model.served_model_name or os.path.basename(str(self.model_source))
            self.kv_role = KVTransferRole(config.kv_transfer, model_id, self.runner.kv_cache)

    def _build_host_tier(self, gib: float | None):
        if gib is None:
            return None
        from tpuserve.kv_cache.host_tier import HostKVTier

        kv = self.runner.kv_cache
        tier = HostKVTier(int(gib * (1 << 30)), tuple(kv.shape), kv.dtype)
        log.info("host KV tier: %d pages (%.2f GiB)", tier.num_slots, gib)
        return tier

    def warmup(self) -> int:
        """Compile every program a step can need; returns how many."""
        n = self.worker.warmup()
        if self.host_tier is not None:
            from tpuserve.kv_cache.host_tier import warmup_pages

            most = warmup_pages(
                self.max_model_len, self.config.cache.block_size, self.config.scheduler.max_num_batched_tokens
            )
            before = self.host_tier.compile_count
            self.runner.kv_cache = self.host_tier.warmup(self.runner.kv_cache, most)
            n += self.host_tier.compile_count - before
        return n

    # ---- requests ----

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival: float | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        remote_kv: Any = None,
    ) -> str:
        """Queue a request. Raises ValueError naming the problem when the input is bad.

        ``cache_salt``: requests share cached prefix pages only with requests of the same salt.
        ``kv_transfer_params`` ``{"do_remote_decode": true}``: offer the prompt's pages to a decode
        engine when done (a producer). ``remote_kv``: the ``PageBatch`` a consumer pulled for this
        prompt (``kv_transfer.KVTransferRole.pull``)."""
        params = params or SamplingParams()
        params.validate(self.config.model.max_logprobs)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenize(prompt)
            elif prompt is not None:
                prompt_token_ids = list(prompt)
            else:
                raise ValueError("prompt: give a string or a list of token ids")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt_token_ids):
            raise ValueError("prompt: token ids must be integers")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(
                f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.arch.vocab_size})"
            )
        bad = [t for t in params.stop_token_ids if t >= self.arch.vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.arch.vocab_size})"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: must be a non-empty string")
        # A server that is no producer serves the request plainly (the decode side then computes
        # the prompt itself), so a router works in front of ordinary servers too.
        export_kv = bool(
            kv_transfer_params
            and kv_transfer_params.get("do_remote_decode")
            and self.kv_role is not None
            and self.kv_role.produces
        )
        if remote_kv is not None:
            page = self.config.cache.block_size
            if remote_kv.num_tokens > len(ids) or remote_kv.pages.shape[1] * page < remote_kv.num_tokens:
                raise ValueError(
                    f"kv_transfer_params: the transferred KV covers "
                    f"{remote_kv.num_tokens} tokens, which does not fit this prompt "
                    f"({len(ids)} tokens, {remote_kv.pages.shape[1]} pages)"
                )
        if params.structured_outputs is not None and self.grammar_factory is None:
            raise ValueError("structured_outputs: this engine has no grammar backend")
        now = arrival if arrival is not None else time.monotonic()
        seqs = []
        for i in range(params.n):
            base = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**32))
            seed = int(np.random.SeedSequence([base & 0xFFFFFFFF, i]).generate_state(1)[0])
            seq = Sequence(
                seq_id=f"{request_id}#{i}",
                request_id=request_id,
                index=i,
                prompt_token_ids=ids,
                params=params,
                seed=seed,
                arrival=now,
                cache_salt=cache_salt,
            )
            seq.detok = IncrementalDetokenizer(
                self.tokenizer, ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )
            seq.stopper = StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.logprobs is not None:
                seq.logprobs = []
            if params.structured_outputs is not None:
                seq.grammar = self.grammar_factory(
                    params.structured_outputs, self.tokenizer, self.arch.vocab_size
                )
            seqs.append(seq)
        seqs[0].remote_kv = remote_kv  # the other completions share its pages through the cache
        state = RequestState(request_id, text, ids, params, seqs, now, export_kv=export_kv)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request_id] = state
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        return self._output(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        """Run one model step. Returns the cumulative output of every request that progressed.

        With async scheduling the next step is scheduled and dispatched before this one's tokens
        reach the host: the device computes step i+1 while the host detokenizes step i (so a call
        returns the outputs of the step dispatched by the previous call).
        """
        if self.speculative is not None:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        self._move_pages(sched)
        if self.draft_runner is not None:
            self._run_draft_head(sched.work)
        if not self.async_scheduling:
            return self._process(self._dispatch(sched.work, None)) if sched.work else []
        prev = self._inflight
        self._inflight = self._dispatch(sched.work, prev) if sched.work else None
        outputs = self._process(prev) if prev is not None else []
        if self._inflight is not None and not self.requests:
            self._inflight = None  # everything it computes belongs to finished requests
        return outputs

    def _ngram_drafter(self, token_ids: np.ndarray, k: int) -> list[int]:
        lo, hi = self.speculative.lookup_range()
        return [
            int(t)
            for t in propose_ngram(token_ids, min_n=lo, max_n=hi, k=k, max_model_len=self.max_model_len)
        ]

    def _propose_drafts(self) -> None:
        """Drafts for every running sequence that decodes next and can verify them."""
        spec = self.speculative
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            p = seq.params
            if seq.num_tokens - seq.num_computed != 1 or not self._may_draft(seq):
                continue
            k = spec.num_speculative_tokens
            if p.max_tokens is not None:
                k = min(k, p.max_tokens - len(seq.output_token_ids) - 1)
            if k <= 0:
                continue
            if self.draft_runner is not None:
                # Placeholders: the scheduler sizes the step (and allocates the drafts' pages) by
                # them; the head fills them in once it has those pages (_run_draft_head).
                k = min(k, self.max_model_len - seq.num_tokens)
                if seq.draft_seed is not None and seq.draft_seed_at == seq.num_computed and k > 0:
                    seq.draft_token_ids = [-1] * k
                continue
            tokens = np.asarray(seq.prompt_token_ids + seq.output_token_ids, np.int64)
            seq.draft_token_ids = list(self.drafter(tokens, k))[:k]

    def _run_draft_head(self, work: list[ScheduledWork]) -> None:
        """Replace the scheduled placeholder drafts with the draft head's proposals."""
        drafting = [w for w in work if w.draft_token_ids]
        if not drafting:
            return
        # Always the configured k (one compiled program): a sequence near its end drafts fewer,
        # and the head's extra writes land past its pages (the reserved page) or its length.
        k = self.speculative.num_speculative_tokens
        drafts = self.draft_runner.propose(
            [w.seq.draft_seed for w in drafting],
            [w.seq.num_computed for w in drafting],
            [w.seq.page_ids for w in drafting],
            k,
        )
        for w, row in zip(drafting, drafts):
            w.draft_token_ids = [int(t) for t in row[: len(w.draft_token_ids)]]
            w.seq.draft_token_ids = list(w.draft_token_ids)

    def _catch_up_draft_head(self, inflight: _InFlight) -> None:
        """After a step: run the draft head over every position the step verified, so its K/V
        follows the target's and each sequence that goes on has a seed to draft from."""
        items, seqs, row0 = [], [], 0
        for w, start in zip(inflight.work, inflight.starts):
            seq, first_row = w.seq, row0
            row0 += w.num_tokens
            seq.draft_seed = None
            n = seq.num_computed - start  # verified positions (rejected drafts rolled back)
            if seq.is_finished or n <= 0 or seq.num_tokens < seq.num_computed + 1 or seq.num_pending:
                continue
            items.append(
                CatchUpSeq(first_row, start, seq.tokens(start + 1, seq.num_computed + 1), list(seq.page_ids))
            )
            seqs.append(seq)
        if not items:
            return
        for seq, seed in zip(seqs, self.draft_runner.catch_up(inflight.features, items)):
            seq.draft_seed, seq.draft_seed_at = seed, seq.num_computed

    @staticmethod
    def _may_draft(seq: Sequence) -> bool:
        """Drafts are verified with the sequence's plain sampling row repeated per position; what
        would need per-draft host state beyond the grammar's masks (penalties counting the drafts,
        the min_tokens ban, per-token logprobs) does not draft."""
        p = seq.params
        return (
            p.logprobs is None
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and len(seq.output_token_ids) >= p.min_tokens
        )

    def _move_pages(self, sched: SchedulerOutput) -> None:
        """Host tier: copy out the cached pages this schedule evicted, then copy in the host hits,
        both dispatched before the step that overwrites / reads those device pages."""
        ps = self.scheduler.prefix_stats
        st = self.stats
        st.prefix_cache_queries, st.prefix_cache_hits = ps.queries, ps.hits
        st.host_cache_queries, st.host_cache_hits = ps.host_queries, ps.host_hits
        for pages, page_ids in sched.remote_loads:
            self.runner.kv_cache = self.kv_role.import_pages(self.runner.kv_cache, pages, page_ids)
        tier = self.host_tier
        if tier is None:
            return
        loading = [h for h, _ in sched.loads]
        tier.pin(loading)  # the saves below must not evict what this step loads
        try:
            if sched.evicted:
                tier.save(self.runner.kv_cache, sched.evicted)
            if sched.loads:
                self.runner.kv_cache = tier.load(self.runner.kv_cache, sched.loads)
        finally:
            tier.unpin(loading)
        st.host_bytes_loaded, st.host_bytes_saved = tier.stats.bytes_loaded, tier.stats.bytes_saved

    def _can_schedule(self, seq: Sequence) -> bool:
        """Whether the scheduler may give ``seq`` work now (always, without async scheduling).

        A sequence whose last token is still on the device can only decode that token (fed on the
        device), and only when its sampling needs no host view of it (grammar, penalties) and it
        cannot have finished by length."""
        if not seq.num_pending:
            return True
        p = seq.params
        if (
            seq.grammar is not None
            or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
        ):
            return False
        if seq.num_tokens - seq.num_computed != 1:
            return False  # preempted: recomputing needs every token on the host
        n_out = len(seq.output_token_ids) + seq.num_pending
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return False
        return seq.num_tokens < self.max_model_len

    def _dispatch(self, work: list[ScheduledWork], prev: _InFlight | None) -> _InFlight:
        items, prompt_rows, row = [], [], 0
        for w in work:
            item = self._scheduled_seq(w)
            if w.seq.num_pending:
                item.feed_from = w.seq.feed_slot
            items.append(item)
            prompt_rows.append(row)
            row += len(item.prompt_logprob_targets or ())
        batch = self.runner.build_batch(items)
        fwd = self.runner.forward(batch, prev.step if prev is not None else None)
        step = self.runner.sample(fwd)
        starts, completes = [], []
        for i, w in enumerate(work):
            starts.append(w.seq.num_computed)
            completes.append(w.completes)
            if w.completes:
                w.seq.num_pending += 1
                w.seq.feed_slot = i
            w.seq.num_computed += w.num_tokens
        return _InFlight(
            work, starts, completes, prompt_rows, step, [len(w.draft_token_ids) for w in work], fwd.features
        )

    def _process(self, inflight: _InFlight) -> list[RequestOutput]:
        result = self.runner.fetch(inflight.step)
        self.stats.steps += 1
        touched: dict[str, RequestState] = {}
        # Logits rows: one per item, plus one per draft it verified (logprobs are per row).
        first_row = np.cumsum([0] + [1 + d for d in inflight.num_drafts])
        for i, (w, start, completes) in enumerate(zip(inflight.work, inflight.starts, inflight.completes)):
            seq = w.seq
            if completes:
                seq.num_pending -= 1
            state = self.requests.get(seq.request_id)
            if state is None or seq.is_finished:
                continue
            if start < len(seq.prompt_token_ids):
                self.stats.prompt_tokens += min(w.num_tokens, len(seq.prompt_token_ids) - start)
            self._take_prompt_logprobs(state, w, start, result.prompt_logprobs, inflight.prompt_rows[i])
            if inflight.num_drafts[i]:
                self._take_verification(seq, inflight.num_drafts[i], int(result.num_accepted[i]))
            if completes:
                try:
                    for j, token in enumerate(result.new_tokens(i)):
                        if seq.is_finished:
                            break  # a stop inside the accepted drafts ends it there
                        self._append_token(state, seq, result, int(first_row[i]) + j, token)
                except Exception as e:  # one request's failure must not take down the batch
                    log.exception("request %s failed", seq.request_id)
                    if isinstance(e, GrammarDeadEndError):
                        self._fail(state, str(e), status=400)
                    else:
                        self._fail(state, f"{type(e).__name__}: {e}")
            touched[state.request_id] = state
        if self.draft_runner is not None and inflight.features is not None:
            self._catch_up_draft_head(inflight)
        outputs = []
        for state in touched.values():
            outputs.append(self._output(state))
            if state.finished:
                self.requests.pop(state.request_id, None)
        return outputs

    def _scheduled_seq(self, w: ScheduledWork) -> ScheduledSeq:
        seq, p = w.seq, w.seq.params
        start = seq.num_computed
        grammar_mask = seq.grammar.fill_bitmask() if (w.completes and seq.grammar is not None) else None
        row = sampling_row(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            seed=seq.seed,
            prompt_ids=seq.prompt_token_ids,
            output_ids=seq.output_token_ids,
            num_pending=seq.num_pending,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            min_tokens=p.min_tokens if w.completes else 0,
            min_tokens_stop_ids=set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids),
            token_bitmask=grammar_mask,
            num_logprobs=p.logprobs,
        )
        draft_masks = None
        if w.draft_token_ids and seq.grammar is not None:
            draft_masks = self._draft_masks(seq, w.draft_token_ids, grammar_mask)
        targets = None
        if p.prompt_logprobs is not None and seq.index == 0:
            # Position j predicts prompt token j + 1; only prompt positions have targets.
            end = min(start + w.num_tokens, len(seq.prompt_token_ids) - 1)
            targets = seq.prompt_token_ids[start + 1 : end + 1] if end > start else None
        end = start + w.num_tokens - len(w.draft_token_ids)
        known = seq.num_tokens - seq.num_pending
        # A token still on the device is a placeholder here; the runner feeds it (feed_from).
        tokens = seq.tokens(start, min(end, known)) + [0] * max(0, end - max(start, known))
        return ScheduledSeq(
            token_ids=tokens,
            num_computed=start,
            draft_token_ids=list(w.draft_token_ids),
            page_ids=list(seq.page_ids),
            sampling=row,
            prompt_logprob_targets=targets,
            num_prompt_logprobs=p.prompt_logprobs or 0,
            draft_bitmasks=draft_masks,
        )

    @staticmethod
    def _draft_masks(seq: Sequence, drafts: list[int], first: np.ndarray) -> np.ndarray:
        """[1 + k, W]: the grammar's mask at each verification row. The matcher walks the drafts
        and is rolled back. A draft the grammar refuses ends the walk: its row's mask excludes it,
        so it is rejected there and the rows after it are never reached (they reuse the mask)."""
        g, masks = seq.grammar, [first]
        walked = 0
        for d in drafts:
            if not g.accept(int(d)):
                break
            walked += 1
            masks.append(g.fill_bitmask())
        if walked:
            g.rollback(walked)
        masks += [masks[-1]] * (len(drafts) + 1 - len(masks))
        return np.stack(masks)

    def _take_prompt_logprobs(
        self, state: RequestState, w: ScheduledWork, start: int, lp: Logprobs | None, row: int
    ) -> None:
        """Record the prompt logprobs this chunk computed (rows from ``row`` of the step's output)."""
        seq = w.seq
        if state.prompt_logprobs is None or seq.index != 0 or lp is None:
            return
        end = min(start + w.num_tokens, len(seq.prompt_token_ids) - 1)
        if seq.num_preemptions and len(state.prompt_logprobs) > start + 1:
            return  # recomputed after preemption: already recorded
        k = seq.params.prompt_logprobs or 0
        for j in range(max(0, end - start)):
            target = seq.prompt_token_ids[start + 1 + j]
            state.prompt_logprobs.append(self._position_logprobs(lp, row + j, target, k))

    def _position_logprobs(self, lp: Logprobs, row: int, token: int, k: int) -> dict[int, Logprob]:
        """The chosen token's entry plus the top ``k`` (the step computed max_logprobs of them)."""
        entry = {
            int(token): Logprob(
                float(lp.token_logprobs[row]),
                int(lp.token_ranks[row]),
                decode_token(self.tokenizer, int(token)),
            )
        }
        for rank, (tid, val) in enumerate(zip(lp.top_ids[row][:k], lp.top_logprobs[row][:k]), start=1):
            entry.setdefault(int(tid), Logprob(float(val), rank, decode_token(self.tokenizer, int(tid))))
        return entry

    def _take_verification(self, seq: Sequence, num_drafts: int, accepted: int) -> None:
        """Count a verification and roll the sequence back over its rejected drafts (their K/V
        lies past its computed length, to be overwritten)."""
        seq.num_computed -= num_drafts - accepted
        st = self.stats
        st.spec_num_drafts += 1
        st.spec_num_draft_tokens += num_drafts
        st.spec_num_accepted_tokens += accepted
        for j in range(accepted):
            st.spec_accepted_per_pos[j] += 1

    def _append_token(
        self, state: RequestState, seq: Sequence, result: StepOutput, row: int, token: int
    ) -> None:
        """Append one new token, sampled at logits row ``row`` of the step."""
        p = seq.params
        seq.output_token_ids.append(token)
        self.stats.generation_tokens += 1
        if state.first_token_time is None:
            state.first_token_time = time.monotonic()
        if seq.logprobs is not None and result.logprobs is not None:
            seq.logprobs.append(self._position_logprobs(result.logprobs, row, token, p.logprobs or 0))
            seq.cumulative_logprob += float(result.logprobs.token_logprobs[row])
        if seq.grammar is not None and not seq.grammar.accept(token):
            raise GrammarDeadEndError(
                f"structured_outputs: the grammar admits no token after {len(seq.output_token_ids) - 1} "
                f"generated tokens (token {token} was sampled from an empty mask): it matches no "
                f"complete text"
            )
        n_out = len(seq.output_token_ids)
        reason, stop_reason = None, None
        if token in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        delta = "" if reason else seq.detok.add_tokens([token])
        if reason is None and n_out >= p.min_tokens:
            emit, matched = seq.stopper.feed(delta)
            seq.text += emit
            if matched is not None:
                reason, stop_reason = "stop", matched
        elif reason is None:
            seq.text += delta  # stop strings only count once min_tokens are out
        if reason is None and seq.grammar is not None and seq.grammar.is_terminated():
            reason = "stop"
        if reason is None and p.max_tokens is not None and n_out >= p.max_tokens:
            reason = "length"
        if reason is None and len(seq.prompt_token_ids) + n_out >= self.max_model_len:
            reason = "length"
        if reason is not None:
            if not isinstance(stop_reason, str):
                seq.text += seq.stopper.feed(seq.detok.flush())[0] + seq.stopper.flush()
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            if state.export_kv and seq.index == 0:
                self._export_kv(state, seq)
            self.scheduler.finish(seq)

    def _export_kv(self, state: RequestState, seq: Sequence) -> None:
        """Offer the prompt's pages (all computed once a token was sampled) before they are freed."""
        n = len(seq.prompt_token_ids)
        pages = seq.page_ids[: -(-n // self.config.cache.block_size)]
        state.kv_transfer_params = self.kv_role.export(state.request_id, self.runner.kv_cache, pages, n)

    def _fail(self, state: RequestState, message: str, status: int = 500) -> None:
        state.error, state.error_status = message, status
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "error"

    def _output(self, state: RequestState) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in state.seqs
        ]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outs,
            finished=state.finished,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.seqs[0].num_cached_tokens,
            error=state.error,
            error_status=state.error_status,
            kv_transfer_params=state.kv_transfer_params,
        )

"""The standalone engine: request lifecycle around the scheduler and the model runner.

``add_request`` validates and queues; ``step`` is one turn of a thin loop over named parts:

    schedule   the scheduler picks the step's work (Scheduler, told what it needs up front)
    draft      speculative decoding proposes and fills drafts (SpecDecodeCoordinator)
    execute    one ragged model step on the runner
    outputs    sampled ids become text, logprobs and finish decisions (OutputProcessor)

``abort_request`` frees a request's pages at once. A request that fails on its own (bad grammar,
...) finishes with an error; the others go on.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tpuserve.kv_cache.block_pool import BlockPool
from tpuserve.server.output_processor import GrammarDeadEndError, OutputProcessor
from tpuserve.server.outputs import RequestOutput
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.server.scheduler import ScheduledWork, ScheduleInputs, Scheduler, SchedulerOutput
from tpuserve.server.sequence import GrammarMatcher, RequestState, Sequence
from tpuserve.spec_decode.coordinator import Drafter, DraftSupport, SpecDecodeCoordinator, draft_masks
from tpuserve.tpu_platform import multihost
from tpuserve.tpu_platform.config import ConfigError, EngineConfig
from tpuserve.tpu_platform.model_runner import PendingStep
from tpuserve.tpu_platform.startup_timing import StartupTimings
from tpuserve.tpu_platform.step_batch import Logprobs, SamplingRow, ScheduledSeq, StepOutput, sampling_row
from tpuserve.tpu_platform.warmup import Warmup
from tpuserve.tpu_platform.worker import Worker

if TYPE_CHECKING:
    import jax

    from tpuserve.kv_cache.host_tier import HostKVTier
    from tpuserve.server.kv_transfer import KVTransferRole

__all__ = ["EngineStats", "GrammarDeadEndError", "LLMEngine", "RequestState"]

log = logging.getLogger(__name__)

# The engine's verification walks a grammar over the drafts (per-row masks), and keeps requests
# with per-token logprobs or penalties on plain decoding.
ENGINE_DRAFT_SUPPORT = DraftSupport(token_masks=True, logprobs=False, penalties=False)


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


@dataclass
class _InFlight:
    """A dispatched step: the work it covers (with where each chunk started) and its device results."""

    work: list[ScheduledWork]
    starts: list[int]  # num_computed of each sequence when the step was dispatched
    completes: list[bool]  # the chunk reaches the sequence's last token: its sample is kept
    prompt_rows: list[int]  # first prompt-logprob row of each item in the step's output
    step: PendingStep
    features: jax.Array | None = None  # the step's draft-head features [T, A] (EAGLE-3 / MTP)
    seq: int = -1  # the step's message number to the other hosts (multi-host engine; else -1)

    def feed_slots(self) -> dict[Sequence, int]:
        """Where each sequence whose sample this step keeps finds it in the step's output (a later
        step dispatched before this one's tokens reach the host feeds them from there)."""
        return {w.seq: i for i, (w, done) in enumerate(zip(self.work, self.completes)) if done}


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        grammar_factory: Callable[[Any, Any, int], GrammarMatcher] | None = None,
        replica: int = 0,
    ):
        """``grammar_factory(structured_output_params, tokenizer, vocab_size)`` builds a matcher with
        ``fill_bitmask() -> int32[ceil(V/32)]``, ``accept(token_id) -> bool``, ``is_terminated()``.
        ``replica``: which data-parallel replica (device subset) this engine runs on."""
        from tpuserve.tpu_platform.device import discover
        from tpuserve.tpu_platform.loader import start_tokenizer_import

        # Where this engine's start-up time goes (logged once when it is ready: log_startup).
        self.startup_timings = timings = StartupTimings()
        start_tokenizer_import(timings)  # beside the backend's start (seconds on a TPU host)
        with timings.phase("devices"):
            # Several hosts: join them before anything touches a device (jax.distributed).
            group = multihost.initialize(config.parallel)
            if group is not None and not group.is_leader:
                raise ConfigError(
                    f"host_rank={group.rank}: only host 0 runs the engine; the other hosts run "
                    f"tpuserve.tpu_platform.multihost.run_follower(config) (`tpuserve serve` does)"
                )
            backend = discover().backend  # the first device query starts the backend
        # The platform's scheduler sizes (its concrete modes: the Worker resolves them).
        config = config.for_backend(backend)
        self.config = config
        self.worker = Worker(config, replica, timings)
        self.worker.load()
        # Loading may have raised the page size to what this max_model_len needs (Worker.load).
        config = self.config = self.worker.config
        self.device, self.dtype = self.worker.device, self.worker.dtype
        self.arch, self.tokenizer = self.worker.loaded_arch(), self.worker.tokenizer
        self.model_source, self.max_model_len = self.worker.model_source, self.worker.loaded_model_len()
        # The other hosts replay each device call of this engine (multihost.py), in its order.
        self.hosts: multihost.Leader | None = (
            None if group is None else multihost.Leader(group, replica=replica)
        )
        self._tell_hosts(multihost.PlanMemory())
        num_pages = self.worker.num_pages()
        self._tell_hosts(multihost.InitKVCache(num_pages))
        self.runner = self.worker.init_kv_cache(num_pages)
        t_rest = time.perf_counter()
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
            host_tier=self.host_tier,
        )
        self.speculative = config.speculative
        # Drafts are proposed from the tokens the host has seen, so a drafting sequence needs its
        # last token on the host: with speculation the engine schedules synchronously.
        self.async_scheduling = sched.async_scheduling and self.speculative is None
        # EAGLE-3 / MTP: the draft head beside the runner (None for n-gram).
        self.draft_runner = self.worker.draft_runner
        self.spec_decode: SpecDecodeCoordinator[Sequence] | None = None
        if self.speculative is not None:
            self.spec_decode = SpecDecodeCoordinator(
                self.speculative.num_speculative_tokens,
                self.max_model_len,
                ENGINE_DRAFT_SUPPORT,
                lookup_range=self.speculative.lookup_range(),
                draft_runner=self.draft_runner,
            )
        self.grammar_factory = grammar_factory
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        if self.speculative is not None:
            self.stats.spec_accepted_per_pos = [0] * self.speculative.num_speculative_tokens
        self.eos_token_ids = set(self.arch.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self._seed_rng = np.random.default_rng(config.model.seed)
        self._ids = itertools.count()
        self._inflight: _InFlight | None = None
        self._warmup: Warmup | None = None  # a background warm-up (start_warmup)
        self.kv_role: KVTransferRole | None = None
        if config.kv_transfer is not None:
            from tpuserve.server.kv_transfer import KVTransferRole

            model_id = config.model.served_model_name or os.path.basename(str(self.model_source))
            self.kv_role = KVTransferRole(
                config.kv_transfer,
                model_id,
                self.runner.kv_cache,
                tp_size=config.parallel.tensor_parallel_size,
            )
        timings.add("engine setup", time.perf_counter() - t_rest)

    def log_startup(self) -> None:
        """Log where start-up went, once, in one INFO line (warm-up calls it when it is done; an
        engine that never warms up has its owner call it)."""
        self.startup_timings.log_once(log)

    def _build_host_tier(self, gib: float | None) -> HostKVTier | None:
        if gib is None:
            return None
        from tpuserve.kv_cache.host_tier import HostKVTier

        kv = self.runner.kv_cache
        tier = HostKVTier(int(gib * (1 << 30)), tuple(kv.shape), kv.dtype)
        log.info("host KV tier: %d pages (%.2f GiB)", tier.num_slots, gib)
        return tier

    def _tell_hosts(self, op: multihost.Op) -> int:
        """Send a device call to the other hosts before making it here; its message number
        (-1 on one host). Raises HostLost once a host stopped."""
        return -1 if self.hosts is None else self.hosts.send(op)

    def shutdown(self) -> None:
        """Release the other hosts (their follower loops return); a no-op on one host."""
        self.stop_warmup()
        if self.hosts is not None:
            self.hosts.shutdown()

    def warmup(self, *, progress: bool = True) -> int:
        """Compile every program a step can need (on a thread pool); returns how many."""
        self._tell_hosts(multihost.Warmup())
        n = self._warm_host_tier() + self.worker.warmup(progress=progress)
        self.log_startup()
        return n

    def start_warmup(self, *, progress: bool = True) -> Warmup:
        """Compile the programs of a first short request and return; the rest compile on a thread
        pool while the engine steps (steps keep to what is compiled: ``ModelRunner.step_shape``).
        ``warmup_remaining`` counts down to 0. Call before the engine's first step."""
        self._warm_host_tier()
        # Followers compile in their foreground: warm-up runs no collective, so their order
        # against this host's background compiles does not matter.
        self._tell_hosts(multihost.Warmup())
        self._warmup = self.worker.start_warmup(progress=progress)
        self.log_startup()  # ready to serve: the rest compiles in the background
        return self._warmup

    @property
    def warmup_remaining(self) -> int:
        """Compile tasks of a background warm-up not finished yet (0: none running)."""
        return 0 if self._warmup is None else self._warmup.remaining

    def stop_warmup(self) -> None:
        """Drop the background compiles not started yet (shutting down)."""
        if self._warmup is not None:
            self._warmup.cancel()

    def _warm_host_tier(self) -> int:
        """The host tier's page movers, in the foreground: their warm-up moves the real cache."""
        if self.host_tier is None:
            return 0
        from tpuserve.kv_cache.host_tier import warmup_pages

        most = warmup_pages(
            self.max_model_len, self.config.cache.block_size, self.config.scheduler.max_num_batched_tokens
        )
        before = self.host_tier.compile_count
        self.runner.kv_cache = self.host_tier.warmup(self.runner.kv_cache, most)
        return self.host_tier.compile_count - before

    # ---- speculative decoding's swap point ----

    @property
    def drafter(self) -> Drafter:
        """Where n-gram drafts come from: ``drafter(token_ids [N], k) -> up to k ids`` (tests swap
        in replaying / adversarial ones)."""
        return self._coordinator().drafter

    @drafter.setter
    def drafter(self, drafter: Drafter) -> None:
        self._coordinator().drafter = drafter

    def _ngram_drafter(self, token_ids: np.ndarray, k: int) -> list[int]:
        return self._coordinator().ngram_drafter(token_ids, k)

    def _coordinator(self) -> SpecDecodeCoordinator[Sequence]:
        if self.spec_decode is None:
            raise AttributeError("this engine does not speculate (no speculative_config)")
        return self.spec_decode

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
        kv_transfer_params: dict[str, Any] | None = None,
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
        bad = [t for t in params.stop_token_ids or () if t >= self.arch.vocab_size]
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
            self.outputs.start(seq)
            if params.structured_outputs is not None:
                assert self.grammar_factory is not None  # checked above
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
                self._finish(seq)
                seq.finish_reason = "abort"
        return self.outputs.output(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- one step ----

    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one model step. Returns the cumulative output of every request that progressed
        (``finished_only``: of those that finished; offline generation reads nothing else, and
        building a batch of 128 requests' outputs every step is a good part of the host's step).

        With async scheduling the next step is scheduled and dispatched before this one's tokens
        reach the host: the device computes step i+1 while the host detokenizes step i (so a call
        returns the outputs of the step dispatched by the previous call).
        """
        # While a background warm-up runs, a step is no larger than the largest compiled one.
        self.scheduler.token_budget = min(
            self.config.scheduler.max_num_batched_tokens, self.runner.max_ready_tokens()
        )
        sched = self.scheduler.schedule(ScheduleInputs(held=self._held_back(), drafts=self._propose_drafts()))
        self._move_pages(sched)
        drafts = self._drafts(sched.work)
        if not self.async_scheduling:
            return (
                self._process(self._dispatch(sched.work, drafts, None), finished_only) if sched.work else []
            )
        prev = self._inflight
        self._inflight = self._dispatch(sched.work, drafts, prev) if sched.work else None
        outputs = self._process(prev, finished_only) if prev is not None else []
        if self._inflight is not None and not self.requests:
            self._inflight = None  # everything it computes belongs to finished requests
        return outputs

    def _held_back(self) -> frozenset[Sequence]:
        """Sequences the next schedule must skip: the step in flight sampled their last token, and
        their next step cannot feed it from the device. (Only that step holds pending tokens: the
        one before it was processed by the previous call.)"""
        prev = self._inflight
        if prev is None:
            return frozenset()
        return frozenset(
            w.seq
            for w, done in zip(prev.work, prev.completes)
            if done and not w.seq.can_feed_from_device(self.max_model_len)
        )

    def _propose_drafts(self) -> dict[Sequence, int]:
        """How many drafts each running sequence would verify (the scheduler sizes the step by it)."""
        if self.spec_decode is None:
            return {}
        return self.spec_decode.propose((seq, seq.draft_facts) for seq in self.scheduler.running)

    def _drafts(self, work: list[ScheduledWork]) -> list[list[int]]:
        """Each scheduled item's draft tokens (empty where it verifies none)."""
        if self.spec_decode is None:
            return [[] for _ in work]
        return self.spec_decode.drafts([(w.seq, w.num_drafts) for w in work])

    def _move_pages(self, sched: SchedulerOutput) -> None:
        """Host tier: copy out the cached pages this schedule evicted, then copy in the host hits,
        both dispatched before the step that overwrites / reads those device pages."""
        ps = self.scheduler.prefix_stats
        st = self.stats
        st.prefix_cache_queries, st.prefix_cache_hits = ps.queries, ps.hits
        st.host_cache_queries, st.host_cache_hits = ps.host_queries, ps.host_hits
        for pages, page_ids in sched.remote_loads:
            assert self.kv_role is not None  # the scheduler loads remote pages only for a consumer
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

    def _dispatch(
        self, work: list[ScheduledWork], drafts: list[list[int]], prev: _InFlight | None
    ) -> _InFlight:
        feed_slots = prev.feed_slots() if prev is not None else {}
        items, prompt_rows, row = [], [], 0
        completes = [w.completes for w in work]
        starts = []
        for w, d, done in zip(work, drafts, completes):
            s = w.seq
            item = self._scheduled_seq(w, d, done)
            if s.num_pending:
                item.feed_from = feed_slots[s]
            items.append(item)
            prompt_rows.append(row)
            if item.prompt_logprob_targets:
                row += len(item.prompt_logprob_targets)
            starts.append(s.num_computed)
        batch = self.runner.build_batch(items)
        seq = self._tell_hosts(multihost.RunStep(batch, prev.seq if prev is not None else -1))
        fwd = self.runner.forward(batch, prev.step if prev is not None else None)
        step = self.runner.sample(fwd)
        for w, done in zip(work, completes):
            if done:
                w.seq.num_pending += 1
            # Drafts' K/V counts once verified: the accepted ones are added after the step.
            w.seq.num_computed += w.num_tokens - w.num_drafts
        return _InFlight(work, starts, completes, prompt_rows, step, fwd.features, seq)

    def _process(self, inflight: _InFlight, finished_only: bool = False) -> list[RequestOutput]:
        result = self._fetch(inflight.step)
        self.stats.steps += 1
        touched: dict[str, RequestState] = {}
        # Logits rows: one per item, plus one per draft it verified (logprobs are per row).
        first_row = np.cumsum([0] + [1 + w.num_drafts for w in inflight.work]).tolist()
        # Python ints once for the whole step, not per sequence (StepOutput.new_tokens).
        sampled, accepted = result.token_ids.tolist(), result.num_accepted.tolist()
        for i, (w, start, completes) in enumerate(zip(inflight.work, inflight.starts, inflight.completes)):
            seq = w.seq
            if completes:
                seq.num_pending -= 1
            state = self.requests.get(seq.request_id)
            if state is None or seq.is_finished:
                continue
            if start < len(seq.prompt_token_ids):
                self.stats.prompt_tokens += min(w.num_tokens, len(seq.prompt_token_ids) - start)
                self.outputs.take_prompt_logprobs(
                    state, seq, start, w.num_tokens, result.prompt_logprobs, inflight.prompt_rows[i]
                )
            if w.num_drafts:
                assert self.spec_decode is not None
                seq.num_computed += self.spec_decode.verified(w.num_drafts, accepted[i])
            if completes:
                try:
                    if not accepted[i]:  # one new token (no drafts, or none accepted)
                        self._append_token(state, seq, sampled[i][0], result.logprobs, first_row[i])
                    else:
                        for j, token in enumerate(sampled[i][: accepted[i] + 1]):
                            if seq.is_finished:
                                break  # a stop inside the accepted drafts ends it there
                            self._append_token(state, seq, token, result.logprobs, first_row[i] + j)
                except Exception as e:  # one request's failure must not take down the batch
                    log.exception("request %s failed", seq.request_id)
                    if isinstance(e, GrammarDeadEndError):
                        self._fail(state, str(e), status=400)
                    else:
                        self._fail(state, f"{type(e).__name__}: {e}")
            touched[state.request_id] = state
        if self.spec_decode is not None:
            if self.draft_runner is not None and inflight.features is not None:
                stepped = [(w.seq, start, w.num_tokens) for w, start in zip(inflight.work, inflight.starts)]
                self.spec_decode.catch_up(inflight.features, stepped)
            self._count_speculation()
        outputs = []
        for state in touched.values():
            finished = state.finished
            if finished or not finished_only:
                outputs.append(self.outputs.output(state))
            if finished:
                self.requests.pop(state.request_id, None)
        return outputs

    def _fetch(self, step: PendingStep) -> StepOutput:
        """The step's results on the host. On several hosts a failed wait is told as the host
        that died, when the watchdog names one within its timeout."""
        if self.hosts is None:
            return self.runner.fetch(step)
        self.hosts.check()
        try:
            return self.runner.fetch(step)
        except Exception as e:
            lost = self.hosts.wait_for_loss()
            if lost is not None:
                raise lost from e
            raise

    def _scheduled_seq(self, w: ScheduledWork, drafts: list[int], completes: bool) -> ScheduledSeq:
        seq, p = w.seq, w.seq.params
        start = seq.num_computed
        n_out = len(seq.output_token_ids) + seq.num_pending
        grammar_mask = seq.grammar.fill_bitmask() if (completes and seq.grammar is not None) else None
        holds_stops = completes and n_out < p.min_tokens
        row = seq.plain_row  # built only for params without penalties
        if grammar_mask is None and not holds_stops and (row is not None or not p.has_penalties):
            if row is None:
                row = seq.plain_row = self._plain_row(seq)
            # Packed into the step's arrays by build_batch before the next step reuses the row.
            row.step = n_out
        else:
            row = self._sampling_row(seq, completes, holds_stops, grammar_mask)
        bitmasks = None
        if drafts and seq.grammar is not None and grammar_mask is not None:
            bitmasks = draft_masks(seq.grammar, drafts, grammar_mask)
        targets = None
        if p.prompt_logprobs is not None and seq.index == 0:
            # Position j predicts prompt token j + 1; only prompt positions have targets.
            end = min(start + w.num_tokens, len(seq.prompt_token_ids) - 1)
            targets = seq.prompt_token_ids[start + 1 : end + 1] if end > start else None
        end = start + w.num_tokens - w.num_drafts
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        # A token still on the device is a placeholder here; the runner feeds it (feed_from).
        if start >= known:  # a decode fed from the device
            tokens = [0] * (end - start)
        else:
            tokens = seq.tokens(start, min(end, known)) + [0] * max(0, end - known)
        return ScheduledSeq(
            token_ids=tokens,
            num_computed=start,
            draft_token_ids=list(drafts),
            # Not copied: build_batch reads it into the step's page table before the next
            # schedule grows it.
            page_ids=seq.page_ids,
            sampling=row,
            prompt_logprob_targets=targets,
            num_prompt_logprobs=p.prompt_logprobs or 0,
            draft_bitmasks=bitmasks,
        )

    def _plain_row(self, seq: Sequence) -> SamplingRow:
        """The row of a step with no grammar mask, penalties or banned stops (its step is set by
        the caller): what ``_sampling_row`` builds then, built once per sequence."""
        return self._sampling_row(seq, False, False, None)

    def _sampling_row(
        self, seq: Sequence, completes: bool, holds_stops: bool, grammar_mask: np.ndarray | None
    ) -> SamplingRow:
        p = seq.params
        return sampling_row(
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
            min_tokens=p.min_tokens if completes else 0,
            min_tokens_stop_ids=(
                set(p.stop_token_ids or ()) | (set() if p.ignore_eos else self.eos_token_ids)
                if holds_stops
                else ()
            ),
            token_bitmask=grammar_mask,
            num_logprobs=p.logprobs,
        )

    def _count_speculation(self) -> None:
        """The coordinator's counts, into the engine's stats (what metrics and snapshots read)."""
        assert self.spec_decode is not None
        counts, st = self.spec_decode.stats, self.stats
        st.spec_num_drafts = counts.num_drafts
        st.spec_num_draft_tokens = counts.num_draft_tokens
        st.spec_num_accepted_tokens = counts.num_accepted_tokens
        st.spec_accepted_per_pos = list(counts.accepted_per_pos)

    def _append_token(
        self, state: RequestState, seq: Sequence, token: int, logprobs: Logprobs | None, row: int
    ) -> None:
        """Append one new token, sampled at logits row ``row`` of the step; act on a finish."""
        self.stats.generation_tokens += 1
        if self.outputs.append(state, seq, token, logprobs, row):
            if state.export_kv and seq.index == 0:
                self._export_kv(state, seq)
            self._finish(seq)

    def _export_kv(self, state: RequestState, seq: Sequence) -> None:
        """Offer the prompt's pages (all computed once a token was sampled) before they are freed."""
        n = len(seq.prompt_token_ids)
        pages = seq.page_ids[: -(-n // self.config.cache.block_size)]
        assert self.kv_role is not None  # a request exports only when kv_role produces
        state.kv_transfer_params = self.kv_role.export(state.request_id, self.runner.kv_cache, pages, n)

    def _finish(self, seq: Sequence) -> None:
        """Take a sequence that ended (finished, failed or aborted) out of scheduling."""
        self.scheduler.finish(seq)
        if self.spec_decode is not None:
            self.spec_decode.forget(seq)

    def _fail(self, state: RequestState, message: str, status: int = 500) -> None:
        state.error, state.error_status = message, status
        for seq in state.seqs:
            if not seq.is_finished:
                self._finish(seq)
                seq.finish_reason = "error"

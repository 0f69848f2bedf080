"""The standalone engine: request lifecycle around the scheduler and the model runner.

``add_request`` validates and queues; ``step`` schedules, runs one ragged model step, and turns sampled
ids into text, logprobs and finish decisions; ``abort_request`` frees a request's pages at once. A
request that fails on its own (bad grammar, ...) finishes with an error; the others go on.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from tpuserve.kv_cache.block_pool import BlockPool
from tpuserve.server.detokenizer import IncrementalDetokenizer, StopStringMatcher, decode_token
from tpuserve.server.outputs import CompletionOutput, Logprob, RequestOutput
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.server.scheduler import ScheduledWork, Scheduler
from tpuserve.server.sequence import Sequence, SeqStatus
from tpuserve.tpu_platform.config import ConfigError, EngineConfig
from tpuserve.tpu_platform.device import discover, enable_compilation_cache, resolve_dtype
from tpuserve.tpu_platform.loader import load_model
from tpuserve.tpu_platform.model_runner import ModelRunner
from tpuserve.tpu_platform.step_batch import Logprobs, SamplingRow, ScheduledSeq

log = logging.getLogger(__name__)

_CPU_KV_BYTES = 1 << 30  # default KV budget on CPU: host RAM is shared with everything else


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival: float
    error: str | None = None
    first_token_time: float | None = None
    prompt_logprobs: list | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 grammar_factory: Callable[[Any, Any, int], Any] | None = None):
        """``grammar_factory(structured_output_params, tokenizer, vocab_size)`` builds a matcher with
        ``fill_bitmask() -> int32[ceil(V/32)]``, ``accept(token_id) -> bool``, ``is_terminated()``."""
        self.config = config
        self.device = discover()
        enable_compilation_cache(config.compilation_cache_dir)
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config.model, self.dtype, config.tokenizer)
        self.arch, self.tokenizer, self.model_source = loaded.arch, loaded.tokenizer, loaded.source
        self.max_model_len = self._resolve_max_model_len()
        num_pages = self._resolve_num_pages(loaded.params)
        self.runner = ModelRunner(config, self.arch, loaded.params, self.device, self.dtype,
                                  num_pages, self.max_model_len)
        self.pool = BlockPool(num_pages, config.block_size)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.grammar_factory = grammar_factory
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self.eos_token_ids = set(self.arch.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()

    # ---- setup ----

    def _resolve_max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        want = self.config.max_model_len or limit
        if want > limit:
            raise ConfigError(f"max_model_len: {want} exceeds the model's max_position_embeddings={limit}")
        return want

    def _resolve_num_pages(self, params) -> int:
        page_bytes = self._page_bytes()
        pages_per_seq = -(-self.max_model_len // self.config.block_size)
        if self.config.num_gpu_blocks is not None:
            num_pages = self.config.num_gpu_blocks
        else:
            if self.device.is_accelerator and self.device.memory_bytes:
                import jax
                weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
                budget = self.config.kv_cache_memory_fraction * self.device.memory_bytes - weight_bytes
            else:
                budget = _CPU_KV_BYTES
            # Never more than every slot at full length could use.
            num_pages = min(int(budget // page_bytes), self.config.max_num_seqs * pages_per_seq + 1)
        if num_pages - 1 < pages_per_seq:
            raise ConfigError(
                f"num_gpu_blocks: the KV cache has {num_pages - 1} usable pages "
                f"({(num_pages - 1) * self.config.block_size} tokens), fewer than one sequence of "
                f"max_model_len={self.max_model_len} needs; lower max_model_len or give more blocks")
        return num_pages

    def _page_bytes(self) -> int:
        import jax.numpy as jnp
        a = self.arch
        return (a.num_layers * self.config.block_size * 2 * a.num_kv_heads * a.head_dim
                * jnp.dtype(self.dtype).itemsize)

    def warmup(self) -> int:
        return self.runner.warmup()

    # ---- requests ----

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def add_request(self, request_id: str | None, prompt: str | list[int] | None,
                    params: SamplingParams | None = None, prompt_token_ids: list[int] | None = None,
                    arrival: float | None = None) -> str:
        """Queue a request. Raises ValueError naming the problem when the input is bad."""
        params = params or SamplingParams()
        params.validate(self.config.max_logprobs)
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
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.arch.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within "
                             f"max_model_len={self.max_model_len}")
        if params.structured_outputs is not None and self.grammar_factory is None:
            raise ValueError("structured_outputs: this engine has no grammar backend")
        now = arrival if arrival is not None else time.monotonic()
        seqs = []
        for i in range(params.n):
            base = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**32))
            seed = int(np.random.SeedSequence([base & 0xFFFFFFFF, i]).generate_state(1)[0])
            seq = Sequence(seq_id=f"{request_id}#{i}", request_id=request_id, index=i,
                           prompt_token_ids=ids, params=params, seed=seed, arrival=now)
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                               params.spaces_between_special_tokens)
            seq.stopper = StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.logprobs is not None:
                seq.logprobs = []
            if params.structured_outputs is not None:
                seq.grammar = self.grammar_factory(params.structured_outputs, self.tokenizer,
                                                   self.arch.vocab_size)
            seqs.append(seq)
        state = RequestState(request_id, text, ids, params, seqs, now)
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
        """Run one model step. Returns the cumulative output of every request that progressed."""
        sched = self.scheduler.schedule()
        if not sched.work:
            return []
        batch = self.runner.build_batch([self._scheduled_seq(w) for w in sched.work])
        result = self.runner.execute(batch)
        self.stats.steps += 1
        touched: dict[str, RequestState] = {}
        pl_row = 0
        for i, w in enumerate(sched.work):
            seq = w.seq
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            if seq.num_computed < len(seq.prompt_token_ids):
                self.stats.prompt_tokens += min(w.num_tokens, len(seq.prompt_token_ids) - seq.num_computed)
            pl_row = self._take_prompt_logprobs(state, w, result.prompt_logprobs, pl_row)
            completes = w.completes
            seq.num_computed += w.num_tokens
            if completes:
                try:
                    self._append_token(state, seq, result.sampled, i)
                except Exception as e:  # one request's failure must not take down the batch
                    log.exception("request %s failed", seq.request_id)
                    self._fail(state, f"{type(e).__name__}: {e}")
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            outputs.append(self._output(state))
            if state.finished:
                self.requests.pop(state.request_id, None)
        return outputs

    def _scheduled_seq(self, w: ScheduledWork) -> ScheduledSeq:
        seq, p = w.seq, w.seq.params
        start = seq.num_computed
        row = SamplingRow(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                          seed=seq.seed, step=len(seq.output_token_ids),
                          repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                          frequency_penalty=p.frequency_penalty, num_logprobs=p.logprobs)
        if row.has_penalties:
            row.output_token_ids, row.prompt_token_ids = seq.output_token_ids, seq.prompt_token_ids
        if w.completes:
            if len(seq.output_token_ids) < p.min_tokens:
                row.banned_ids = sorted(set(p.stop_token_ids)
                                        | (set() if p.ignore_eos else self.eos_token_ids))
            if seq.grammar is not None:
                row.token_bitmask = seq.grammar.fill_bitmask()
        targets = None
        if p.prompt_logprobs is not None and seq.index == 0:
            # Position j predicts prompt token j + 1; only prompt positions have targets.
            end = min(start + w.num_tokens, len(seq.prompt_token_ids) - 1)
            targets = seq.prompt_token_ids[start + 1: end + 1] if end > start else None
        return ScheduledSeq(token_ids=seq.tokens(start, start + w.num_tokens), num_computed=start,
                            page_ids=list(seq.page_ids), sampling=row,
                            prompt_logprob_targets=targets, num_prompt_logprobs=p.prompt_logprobs or 0)

    def _take_prompt_logprobs(self, state: RequestState, w: ScheduledWork, lp: Logprobs | None,
                              row: int) -> int:
        seq = w.seq
        if state.prompt_logprobs is None or seq.index != 0 or lp is None:
            return row
        start = seq.num_computed
        end = min(start + w.num_tokens, len(seq.prompt_token_ids) - 1)
        if seq.num_preemptions and len(state.prompt_logprobs) > start + 1:
            return row + max(0, end - start)  # recomputed after preemption: already recorded
        for j in range(max(0, end - start)):
            target = seq.prompt_token_ids[start + 1 + j]
            state.prompt_logprobs.append(self._position_logprobs(lp, row + j, target))
        return row + max(0, end - start)

    def _position_logprobs(self, lp: Logprobs, row: int, token: int) -> dict[int, Logprob]:
        entry = {int(token): Logprob(float(lp.token_logprobs[row]), int(lp.token_ranks[row]),
                                     decode_token(self.tokenizer, int(token)))}
        for rank, (tid, val) in enumerate(zip(lp.top_ids[row], lp.top_logprobs[row]), start=1):
            entry.setdefault(int(tid), Logprob(float(val), rank, decode_token(self.tokenizer, int(tid))))
        return entry

    def _append_token(self, state: RequestState, seq: Sequence, sampled, row: int) -> None:
        token = int(sampled.token_ids[row])
        p = seq.params
        seq.output_token_ids.append(token)
        self.stats.generation_tokens += 1
        if state.first_token_time is None:
            state.first_token_time = time.monotonic()
        if seq.logprobs is not None and sampled.logprobs is not None:
            seq.logprobs.append(self._position_logprobs(sampled.logprobs, row, token))
            seq.cumulative_logprob += float(sampled.logprobs.token_logprobs[row])
        if seq.grammar is not None and not seq.grammar.accept(token):
            raise ValueError(f"token {token} was rejected by the request's grammar")
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
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            if not isinstance(stop_reason, str):
                seq.text += seq.stopper.feed(seq.detok.flush())[0] + seq.stopper.flush()
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.finish(seq)

    def _fail(self, state: RequestState, message: str) -> None:
        state.error = message
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "error"

    def _output(self, state: RequestState) -> RequestOutput:
        outs = [CompletionOutput(index=s.index, text=s.text, token_ids=list(s.output_token_ids),
                                 cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                                 logprobs=list(s.logprobs) if s.logprobs is not None else None,
                                 finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                for s in state.seqs]
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=outs,
                             finished=state.finished, prompt_logprobs=state.prompt_logprobs,
                             error=state.error)

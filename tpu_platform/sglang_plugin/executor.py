"""Our side of the SGLang worker: weights, KV cache and model steps in JAX, no SGLang, no torch.

The SGLang worker (worker.py) turns each scheduled batch into ``ScheduledSeq`` items whose page
tables are SGLang's own page ids (slots.py) and calls ``JaxExecutor.run``. SGLang's scheduler does
not know our compile buckets, so ``plan_steps`` cuts any batch it sends into runner-sized steps:
at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences each, a long prefill
chunk spread over consecutive steps. Sequences are independent and their KV lives in pages SGLang
already assigned, so splitting changes nothing but the number of model calls.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np

from tpuserve.tpu_platform.step_batch import ScheduledSeq

log = logging.getLogger(__name__)

_CPU_KV_BYTES = 1 << 30  # default KV budget on CPU hosts (shared host RAM), as our own engine


@dataclass(frozen=True)
class ExecutorConfig:
    model_path: str
    page_size: int  # SGLang's page_size; our block_size
    max_model_len: int
    dtype: str = "auto"  # our names: auto / float32 / bfloat16 / float16
    max_total_tokens: int | None = None  # SGLang's --max-total-tokens; None: sized from memory
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    kv_cache_memory_fraction: float = 0.5
    attention_impl: str = "auto"
    warmup: bool | None = None  # None: compile every bucket up front on accelerators only


@dataclass
class _Piece:
    """One sequence's share of one runner step: ``seq`` (a chunk of it) for caller index ``index``."""

    index: int
    seq: ScheduledSeq
    last: bool  # the chunk that ends the caller's item: its sample is the answer


def plan_steps(seqs: list[ScheduledSeq], page_size: int, max_tokens: int,
               max_seqs: int) -> list[list[_Piece]]:
    """Cut a batch into steps within the runner's limits; each sequence at most once per step.

    Chunks of one sequence land in consecutive steps in order, so each chunk finds the K/V of the
    previous one already written. A chunk's page table covers only the tokens it reaches.
    """
    pending = [(i, 0) for i in range(len(seqs))]  # (caller index, tokens of it done)
    steps: list[list[_Piece]] = []
    while pending:
        step: list[_Piece] = []
        budget = max_tokens
        later = []
        for i, done in pending:
            s = seqs[i]
            left = len(s.token_ids) - done
            if budget == 0 or len(step) == max_seqs:
                later.append((i, done))
                continue
            take = min(left, budget)
            start = s.num_computed + done
            pages = -(-(start + take) // page_size)
            piece = replace(s, token_ids=s.token_ids[done: done + take], num_computed=start,
                            page_ids=s.page_ids[:pages])
            step.append(_Piece(i, piece, last=(take == left)))
            budget -= take
            if take < left:
                later.append((i, done + take))
        steps.append(step)
        pending = later
    return steps


class JaxExecutor:
    """Owns the model (weights + KV cache in JAX arrays) and runs steps indexed by SGLang's pages."""

    def __init__(self, cfg: ExecutorConfig):
        from tpuserve.tpu_platform.config import EngineConfig
        from tpuserve.tpu_platform.device import discover, enable_compilation_cache, resolve_dtype
        from tpuserve.tpu_platform.loader import load_model
        from tpuserve.tpu_platform.model_runner import ModelRunner

        t0 = time.perf_counter()
        self.cfg = cfg
        self.device = discover()
        enable_compilation_cache()
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        loaded = load_model(cfg.model_path, self.dtype)
        self.arch = loaded.arch
        self.max_model_len = min(cfg.max_model_len, self.arch.max_position_embeddings)
        self.usable_pages = self._usable_pages(loaded.params)
        # +1: page 0 is reserved by both SGLang (padding) and us; SGLang's pages are 1..usable.
        self.num_pages = self.usable_pages + 1
        self.config = EngineConfig(
            model=cfg.model_path, dtype=cfg.dtype, max_model_len=self.max_model_len,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            block_size=cfg.page_size, attention_impl=cfg.attention_impl,
            kv_cache_memory_fraction=cfg.kv_cache_memory_fraction, num_gpu_blocks=self.num_pages)
        self.runner = ModelRunner(self.config, self.arch, loaded.params, self.device, self.dtype,
                                  self.num_pages, self.max_model_len)
        self.steps = 0
        self.model_calls = 0
        warm = cfg.warmup if cfg.warmup is not None else self.device.is_accelerator
        if warm:
            self.runner.warmup()
        self.compiles_after_init = self.runner.compile_count
        log.info("tpuserve JAX executor ready in %.1fs: backend=%s dtype=%s, KV cache %s in JAX "
                 "(%d pages x %d tokens, %.1f MiB), %d programs compiled",
                 time.perf_counter() - t0, self.device.backend, np.dtype(self.dtype).name,
                 tuple(self.runner.kv_cache.shape), self.usable_pages, cfg.page_size,
                 self.kv_cache_bytes / 2**20, self.compiles_after_init)

    def _usable_pages(self, params) -> int:
        spec_bytes = self._page_bytes()
        if self.cfg.max_total_tokens is not None:
            return max(1, self.cfg.max_total_tokens // self.cfg.page_size)
        if self.device.is_accelerator and self.device.memory_bytes:
            import jax
            weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
            budget = self.cfg.kv_cache_memory_fraction * self.device.memory_bytes - weights
        else:
            budget = _CPU_KV_BYTES
        return max(1, int(budget // spec_bytes))

    def _page_bytes(self) -> int:
        from tpuserve.kv_cache.layout import KVCacheSpec
        return KVCacheSpec(self.arch.num_layers, 1, self.cfg.page_size, self.arch.num_kv_heads,
                           self.arch.head_dim, self.dtype).bytes_per_page

    @property
    def capacity_tokens(self) -> int:
        """Tokens SGLang may place: its pool size (pages 1..usable_pages)."""
        return self.usable_pages * self.cfg.page_size

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.runner.kv_cache.nbytes)

    @property
    def recompiles(self) -> int:
        """Programs compiled after start-up (non-zero while serving after a warm-up is a bug)."""
        return self.runner.compile_count - self.compiles_after_init

    def run(self, seqs: list[ScheduledSeq]) -> np.ndarray:
        """Compute every sequence's scheduled tokens; return one sampled id per sequence (int32)."""
        out = np.zeros(len(seqs), np.int32)
        if not seqs:
            return out
        for step in plan_steps(seqs, self.cfg.page_size, self.config.max_num_batched_tokens,
                               self.config.max_num_seqs):
            batch = self.runner.build_batch([p.seq for p in step])
            sampled = self.runner.execute(batch).sampled.token_ids
            sampled = np.asarray(sampled)[: len(step)]
            self.model_calls += 1
            for p, tok in zip(step, sampled):
                if p.last:
                    out[p.index] = tok
        self.steps += 1
        return out

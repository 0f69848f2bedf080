"""ModelRunner: a StepBatch in, sampled tokens (and logprobs) out. Owns weights and the KV cache.

Shapes are padded to buckets so XLA compiles a bounded set of programs:
    T (token slots)       one of config.token_buckets (powers of two up to max_num_batched_tokens)
    S (sequence slots)    min(T, max_num_seqs)
    pages_per_seq         powers of four up to the pages of max_model_len (just the maximum for the
                          blocked CPU attention, whose cost does not depend on it)
``warmup()`` compiles every (T, pages_per_seq) pair; ``compile_count`` counts every trace, so a
compile while serving shows up as a rise after warm-up.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from tpuserve.attention.dispatch import resolve_impl
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.kv_cache.layout import RESERVED_PAGE, KVCacheSpec
from tpuserve.tpu_platform import sampler
from tpuserve.tpu_platform.config import EngineConfig
from tpuserve.tpu_platform.device import DeviceInfo
from tpuserve.tpu_platform.models.arch import ModelArch
from tpuserve.tpu_platform.models.decoder import forward
from tpuserve.tpu_platform.models.weights import unstack_layers
from tpuserve.tpu_platform.step_batch import (Logprobs, SamplingRow, ScheduledSeq, StepBatch, StepOutput,
                                     pack_sampling_rows)

log = logging.getLogger(__name__)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArch, params: dict, device: DeviceInfo,
                 dtype, num_pages: int, max_model_len: int):
        self.config = config
        self.arch = arch
        self.layer_loop = config.layer_loop
        if self.layer_loop == "auto":
            self.layer_loop = "unroll" if device.backend == "cpu" else "scan"
        self.params = unstack_layers(params) if self.layer_loop == "unroll" else params
        self.dtype = dtype
        self.page_size = config.block_size
        self.max_model_len = max_model_len
        self.attn_impl = resolve_impl(config.attention_impl, device.backend)
        self.kv_spec = KVCacheSpec(arch.num_layers, num_pages, self.page_size, arch.num_kv_heads,
                                   arch.head_dim, dtype)
        self.kv_cache = self.kv_spec.allocate()
        self.max_pages_per_seq = math.ceil(max_model_len / self.page_size)
        # The blocked path's work follows the live context, not the table width: one page bucket.
        self.page_buckets = ((self.max_pages_per_seq,) if self.attn_impl == "blocked"
                             else self._page_buckets(self.max_pages_per_seq))
        self.token_buckets = config.token_buckets
        self._traces = 0
        self._forward = jax.jit(
            functools.partial(self._traced_forward, inv_freq=jnp.asarray(arch.inv_freq())),
            static_argnames=("all_logits",), donate_argnums=(1,))

    @staticmethod
    def _page_buckets(max_pages: int) -> tuple[int, ...]:
        out, b = [], 4
        while b < max_pages:
            out.append(b)
            b *= 4
        out.append(max_pages)
        return tuple(sorted(set(out)))

    def _traced_forward(self, params, kv_cache, token_ids, positions, md, logits_indices, *,
                        all_logits: bool, inv_freq):
        self._traces += 1  # runs only while tracing, i.e. once per compiled program
        if all_logits:
            logits_indices = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
        return forward(params, kv_cache, token_ids, positions, md, logits_indices,
                       arch=self.arch, attn_impl=self.attn_impl, inv_freq=inv_freq)

    @property
    def compile_count(self) -> int:
        """Programs traced so far: model forward variants plus sampler variants."""
        return self._traces + sampler.compile_count()

    # ---- building a padded batch ----

    def build_batch(self, seqs: list[ScheduledSeq]) -> StepBatch:
        """Pad a list of per-sequence work items into a StepBatch of bucketed shapes."""
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        num_tokens = sum(len(s.token_ids) for s in seqs)
        t_slots = _bucket(num_tokens, self.token_buckets)
        s_slots = min(t_slots, self.config.max_num_seqs)
        if len(seqs) > s_slots:
            raise ValueError(f"{len(seqs)} sequences exceed the {s_slots} slots of a {t_slots}-token step")
        kv_lens = np.zeros(s_slots, np.int32)
        pages_per_seq = _bucket(max(len(s.page_ids) for s in seqs), self.page_buckets)
        page_table = np.full((s_slots, pages_per_seq), RESERVED_PAGE, np.int32)
        token_ids = np.zeros(t_slots, np.int32)
        positions = np.zeros(t_slots, np.int32)
        cu = np.zeros(s_slots + 1, np.int32)
        logits_indices = np.zeros(s_slots, np.int32)
        pl_rows, pl_targets, pl_k = [], [], 0
        off = 0
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            if n == 0:
                raise ValueError("a scheduled sequence must compute at least one token")
            kv_len = s.num_computed + n
            if len(s.page_ids) * self.page_size < kv_len:
                raise ValueError(f"sequence {i}: {len(s.page_ids)} pages cannot hold {kv_len} tokens")
            token_ids[off: off + n] = s.token_ids
            positions[off: off + n] = np.arange(s.num_computed, kv_len)
            kv_lens[i] = kv_len
            page_table[i, : len(s.page_ids)] = s.page_ids
            logits_indices[i] = off + n - 1
            if s.prompt_logprob_targets:
                k = len(s.prompt_logprob_targets)
                pl_rows.extend(range(off, off + k))
                pl_targets.extend(s.prompt_logprob_targets)
                pl_k = max(pl_k, s.num_prompt_logprobs)
            off += n
            cu[i + 1] = off
        cu[len(seqs) + 1:] = off
        sampling = pack_sampling_rows([s.sampling for s in seqs], s_slots, self.arch.vocab_size)
        return StepBatch(
            token_ids=token_ids, positions=positions, cu_q_lens=cu, kv_lens=kv_lens,
            page_table=page_table, num_seqs=len(seqs), num_tokens=num_tokens,
            logits_indices=logits_indices, sampling=sampling,
            prompt_logprob_rows=np.asarray(pl_rows, np.int32) if pl_rows else None,
            prompt_logprob_targets=np.asarray(pl_targets, np.int32) if pl_rows else None,
            num_prompt_logprobs=pl_k)

    # ---- running ----

    @staticmethod
    def _metadata(batch: StepBatch) -> AttentionMetadata:
        return AttentionMetadata(
            kv_lens=jnp.asarray(batch.kv_lens), page_indices=jnp.asarray(batch.page_table),
            cu_q_lens=jnp.asarray(batch.cu_q_lens), num_seqs=jnp.asarray([batch.num_seqs], jnp.int32))

    def execute(self, batch: StepBatch) -> StepOutput:
        md = self._metadata(batch)
        all_logits = batch.prompt_logprob_rows is not None
        logits, self.kv_cache = self._forward(
            self.params, self.kv_cache, jnp.asarray(batch.token_ids), jnp.asarray(batch.positions),
            md, jnp.asarray(batch.logits_indices), all_logits=all_logits)
        prompt_lp: Logprobs | None = None
        if all_logits:
            prompt_lp = sampler.compute_logprobs(logits[jnp.asarray(batch.prompt_logprob_rows)],
                                                 batch.prompt_logprob_targets, batch.num_prompt_logprobs)
            logits = logits[jnp.asarray(batch.logits_indices)]
        sampled = sampler.sample(logits, batch.sampling)
        return StepOutput(sampled=sampled, prompt_logprobs=prompt_lp)

    def compute_logits(self, batch: StepBatch) -> np.ndarray:
        """Logits [num_seqs, V] of each sequence's last scheduled token (tests, debugging); updates the cache."""
        md = self._metadata(batch)
        logits, self.kv_cache = self._forward(
            self.params, self.kv_cache, jnp.asarray(batch.token_ids), jnp.asarray(batch.positions),
            md, jnp.asarray(batch.logits_indices), all_logits=False)
        return np.asarray(logits)[: batch.num_seqs]

    def warmup(self) -> int:
        """Compile every (token bucket, page bucket) forward and the common sampler variants.

        Returns the number of programs compiled.
        """
        before = self.compile_count
        for t in self.token_buckets:
            for p in self.page_buckets:
                seq = ScheduledSeq(token_ids=[0], num_computed=0, page_ids=[RESERVED_PAGE] * p,
                                   sampling=SamplingRow())
                batch = self.build_batch([seq])
                # Grow the token count to the bucket; as num_seqs=0 below, nothing is written or attended.
                batch = self._pad_only(batch, t)
                self.execute(batch)
        # The sampler variants common requests hit: greedy, plain temperature, top-k/top-p.
        vocab = self.arch.vocab_size
        for s_slots in sorted({min(t, self.config.max_num_seqs) for t in self.token_buckets}):
            logits = jnp.zeros((s_slots, vocab), jnp.float32)
            for row in (SamplingRow(temperature=1.0), SamplingRow(temperature=1.0, top_p=0.9)):
                sampler.sample(logits, pack_sampling_rows([row], s_slots, vocab))
        jax.block_until_ready(self.kv_cache)
        log.info("warm-up compiled %d programs", self.compile_count - before)
        return self.compile_count - before

    def _pad_only(self, batch: StepBatch, t_slots: int) -> StepBatch:
        s_slots = min(t_slots, self.config.max_num_seqs)
        return StepBatch(
            token_ids=np.zeros(t_slots, np.int32), positions=np.zeros(t_slots, np.int32),
            cu_q_lens=np.zeros(s_slots + 1, np.int32), kv_lens=np.zeros(s_slots, np.int32),
            page_table=np.zeros((s_slots, batch.page_table.shape[1]), np.int32), num_seqs=0,
            num_tokens=0, logits_indices=np.zeros(s_slots, np.int32),
            sampling=pack_sampling_rows([], s_slots, self.arch.vocab_size))

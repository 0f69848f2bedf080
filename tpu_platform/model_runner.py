"""ModelRunner: a StepBatch in, sampled tokens (and logprobs) out. Owns weights and the KV cache.

Shapes are padded to buckets so XLA compiles a bounded set of programs:
    T (token slots)       one of config.token_buckets (powers of two up to max_num_batched_tokens)
    S (sequence slots)    min(T, max_num_seqs)
    R (logits rows)       S when nothing is speculated, else min(T, S * (1 + K)): one per T bucket
    K (draft slots)       num_speculative_tokens when the batch's drafts fit, else a power of two
    pages_per_seq         powers of four up to the pages of max_model_len (just the maximum for the
                          blocked CPU attention, whose cost does not depend on it)
``warmup()`` compiles every (T, pages_per_seq) pair and every sampler variant, and, when drafts are
expected (``num_speculative_tokens`` > 0), the drafted shapes of every T with their verification
programs (rejection_sampler.py); ``compile_count`` counts every trace, so a compile while
serving shows up as a rise after warm-up. ``start_warmup()`` does the same on a thread pool
(tpu_platform/warmup.py) and returns once the shapes of a first short request are compiled; until
the rest are, ``build_batch`` uses only compiled (T, pages_per_seq) pairs and
``max_ready_tokens`` tells the scheduler how large a step may be, so nothing compiles on the
request path. An unrolled runner (CPU) first compiles the first shapes as a layer scan, which
compiles ~7x faster and computes the same values (the same layer math, looped instead of inlined);
steps use it until the unrolled program of their shape is ready, then the stacked weights are released.

A step runs in two dispatches that return at once (JAX dispatches asynchronously): ``forward``
(feeds, model, logits) and ``sample`` (sampler, draft acceptance). ``fetch`` waits for the host
copy. Front ends overlap host work with the device between them: the vLLM worker builds its
grammar bitmask while ``forward`` runs; the engine schedules step i+1 while step i runs, feeding
step i's tokens to step i+1 on the device (``StepBatch.feed_rows``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpuserve.attention.dispatch import split_kv
from tpuserve.attention.kv_cache_shape import kv_storage_dtype
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.attention.names import AttentionImpl
from tpuserve.attention.pallas_tpu import generation_block_sizes
from tpuserve.kv_cache.layout import RESERVED_PAGE, KVCacheSpec, gathered_table_format, kv_cache_format
from tpuserve.quant import pallas_tpu_matmul
from tpuserve.quant.fp4 import scales_as_bytes
from tpuserve.tpu_platform import kv_scales as ks
from tpuserve.tpu_platform.config import EngineConfig, LayerLoop
from tpuserve.tpu_platform.device import DeviceInfo, HostSource, place
from tpuserve.tpu_platform.executable_cache import CachedJit, ExecutableCache
from tpuserve.tpu_platform.linear import quant_linear_impls
from tpuserve.tpu_platform.mesh import MODEL_AXIS, model_axis_size
from tpuserve.tpu_platform.models.arch import ModelArch
from tpuserve.tpu_platform.models.decoder import compute_logits, forward
from tpuserve.tpu_platform.models.sharding import (
    check_expert_parallel,
    kv_cache_partition_spec,
    param_partition_specs,
)
from tpuserve.tpu_platform.models.weights import unstack_layers
from tpuserve.tpu_platform.rejection_sampler import RejectionSampler
from tpuserve.tpu_platform.sampler import Sampler, logprob_rows_bucket
from tpuserve.tpu_platform.step_batch import (
    Logprobs,
    SamplingBatch,
    ScheduledSeq,
    StepBatch,
    StepOutput,
    pack_sampling_rows,
)
from tpuserve.tpu_platform.warmup import CompileTask, ShapeGroup, Warmup, WarmupPlan

log = logging.getLogger(__name__)

# The prompt a first request is expected to fit in one step (a chat turn under a system prompt):
# its token bucket compiles before a background warm-up lets the server answer.
FIRST_PROMPT_TOKENS = 64


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class StepLayout:
    """Where each int32 input of a step sits in the one buffer the host ships per step.

    One host->device copy per step instead of eight: on a TPU each copy costs the host tens of
    microseconds, which a small model's step cannot hide. Static (the program's cache key); the
    shapes it implies are the ones the bucketed StepBatch already fixes.
    Order: token_ids [T], feed_rows [T], positions [T], kv_lens [S], page_table [S, P] (row-major),
    cu_q_lens [S+1], num_seqs [1], logits_indices [R].
    """

    tokens: int  # T
    seqs: int  # S
    pages: int  # P, pages per sequence
    rows: int  # R, logits rows

    @classmethod
    def of(cls, batch: StepBatch) -> StepLayout:
        s, p = batch.page_table.shape
        return cls(len(batch.token_ids), s, p, len(batch.logits_indices))

    def _sizes(self) -> tuple[int, ...]:
        t, s = self.tokens, self.seqs
        return (t, t, t, s, s * self.pages, s + 1, 1, self.rows)

    def pack(self, batch: StepBatch, feed_rows: np.ndarray) -> np.ndarray:
        parts = (
            batch.token_ids,
            feed_rows,
            batch.positions,
            batch.kv_lens,
            batch.page_table.reshape(-1),
            batch.cu_q_lens,
            np.asarray([batch.num_seqs], np.int32),
            batch.logits_indices,
        )
        for part, size in zip(parts, self._sizes()):
            if part.shape != (size,):
                raise ValueError(f"step input of shape {part.shape} does not fit the layout {self}")
        return np.concatenate(parts).astype(np.int32, copy=False)

    def unpack(self, packed: jax.Array):
        """(token_ids, feed_rows, positions, AttentionMetadata, logits_indices), sliced statically."""
        ends = np.cumsum(self._sizes())
        starts = np.concatenate([[0], ends[:-1]])
        tok, feed, pos, kv_lens, pages, cu, num_seqs, rows = (
            packed[int(a) : int(b)] for a, b in zip(starts, ends)
        )
        md = AttentionMetadata(
            kv_lens=kv_lens,
            page_indices=pages.reshape(self.seqs, self.pages),
            cu_q_lens=cu,
            num_seqs=num_seqs,
        )
        return tok, feed, pos, md, rows


@dataclass
class ForwardState:
    """A dispatched forward pass: device logits [R, V] of the sampled rows, their argmax [R] i32
    (a greedy batch's tokens, computed in the same program so it needs no sampler dispatch, and
    padded to the next step's feed source), the
    final hidden states [T, H] of every row (prompt logprobs score them), and the draft head's
    features [T, A] of every row (``ModelRunner(draft_aux_layers=...)``; the final hidden states
    when that is ())."""

    batch: StepBatch
    logits: jax.Array
    hidden: jax.Array
    features: jax.Array | None = None
    greedy: jax.Array | None = None
    greedy_last: jax.Array | None = None  # greedy padded to [S_max] (None when R > S_max)


@dataclass
class PendingStep:
    """A dispatched step whose results are still on the device.

    token_ids [S, K+1] and num_accepted [S] (device), or, when nothing was speculated, token_ids
    [S] and num_accepted None (one token per row: the host adds the axis and the zeros, which spares
    the device two small dispatches a step); last_tokens [S_max]: each slot's last new token, the
    feed source of the next step; logprobs / prompt_logprobs as device parts.
    """

    num_seqs: int
    token_ids: jax.Array
    num_accepted: jax.Array | None
    last_tokens: jax.Array
    logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None
    prompt_logprob_rows: np.ndarray | None = None  # which rows of prompt_logprobs the host keeps


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        params: dict,
        device: DeviceInfo,
        dtype,
        num_pages: int | None,
        max_model_len: int,
        num_speculative_tokens: int | None = None,
        mesh=None,
        kv_cache_dtype=None,
        kv_scales: tuple[float, float] | None = None,
        calibration_tokens: np.ndarray | None = None,
        draft_aux_layers: tuple[int, ...] | None = None,
        executable_cache_dir: str | None = None,
    ):
        """num_pages: KV pages to allocate; None defers the cache to ``allocate_kv_cache`` (so that
        ``step_memory`` can size it first).
        num_speculative_tokens: the most drafts a sequence verifies per step (the draft slots
        ``warmup`` compiles); None takes the speculative config's, 0 when there is none.
        mesh: the ("data", "model") mesh to run on (``tpu_platform/mesh.py``); None: the default
        device. Weights and KV heads split over "model" (a MoE model's experts too, on E, with
        ``config.parallel.enable_expert_parallel``); logits come back replicated, so the sampler
        runs on every device of the mesh alike.
        kv_cache_dtype: the KV cache's dtype (None: ``dtype``). An FP8 cache needs its
        (k_scale, v_scale): ``kv_scales``, or ``calibration_tokens`` to measure them from
        (``calibrate_kv_scales``; tpu_platform/kv_scales.py).
        draft_aux_layers: what a draft head reads (models/draft_head.py): None, nothing;
        () the final hidden states (MTP); layer ids, the residual streams entering those layers,
        concatenated (EAGLE-3). ``ForwardState.features`` carries them.
        executable_cache_dir: where warm-up keeps the compiled forwards across restarts
        (executable_cache.py); None: nowhere (each start traces and compiles them)."""
        # A Worker's config has its modes resolved already (a no-op here); one built by hand
        # (tests, benchmarks) gets the same one rule.
        config = self.config = config.with_modes_resolved(device.backend)
        self.mesh = mesh
        if num_speculative_tokens is None:
            spec = config.speculative
            num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.draft_aux_layers = None if draft_aux_layers is None else tuple(int(i) for i in draft_aux_layers)
        self.arch = arch
        self.layer_loop = config.compilation.layer_loop
        if self.layer_loop == LayerLoop.SCAN and isinstance(params["layers"], (list, tuple)):
            # layers of different structure (a MoE model's dense layers, weights._stack_layers)
            # have no one body to scan: say so, rather than report a scan that does not happen
            log.info("layer_loop=scan: this model's layers differ in structure; running them unrolled")
            self.layer_loop = LayerLoop.UNROLL
        # The stacked layers, kept beside the unrolled ones for a background warm-up's quick scan
        # programs (None: this model cannot scan, or its loop is a scan already).
        # Not over several processes: every host must run the same program each step, and only
        # the scheduling host warms up in the background.
        one_process = mesh is None or all(d.process_index == jax.process_index() for d in mesh.devices.flat)
        quick = self.layer_loop == LayerLoop.UNROLL and one_process and _scannable(params, arch)
        if quick and device.memory_bytes is not None:
            # the two copies of the layers must fit with room to spare (a big model on CPU: skip)
            layer_bytes = sum(int(a.nbytes) for a in jax.tree.leaves(params["layers"]))
            quick = layer_bytes <= QUICK_TIER_MEMORY_SHARE * device.memory_bytes
            if not quick:
                log.info(
                    "warm-up: no scan tier (a second copy of %.1f GB of layers would not fit)",
                    layer_bytes / 1e9,
                )
        stacked = params if quick else None
        params = unstack_layers(params) if self.layer_loop == LayerLoop.UNROLL else params
        self._replicated = None if mesh is None else NamedSharding(mesh, P())
        self._kv_sharding = None if mesh is None else NamedSharding(mesh, kv_cache_partition_spec(MODEL_AXIS))
        # Experts split on E over the "model" axis (--enable-expert-parallel); on one device there
        # is nothing to split.
        self.expert_parallel = bool(config.parallel.enable_expert_parallel) and model_axis_size(mesh) > 1
        if self.expert_parallel:
            ep = model_axis_size(mesh)
            check_expert_parallel(arch, ep)
            assert arch.moe is not None  # checked just above
            e = arch.moe.num_experts
            log.info("expert parallel: %d experts over %d devices, %d each", e, ep, e // ep)
        elif config.parallel.enable_expert_parallel:
            log.info("enable_expert_parallel on one device: every expert stays on it")
        if mesh is not None:
            specs = param_partition_specs(params, MODEL_AXIS, expert_parallel=self.expert_parallel)
            params = jax.tree.map(lambda a, s: place(a, NamedSharding(mesh, s)), params, specs)
            if stacked is not None:
                specs = param_partition_specs(stacked, MODEL_AXIS, expert_parallel=self.expert_parallel)
                stacked = jax.tree.map(lambda a, s: place(a, NamedSharding(mesh, s)), stacked, specs)
        if device.backend == "tpu":  # the Pallas kernels read NVFP4 scales as bytes: convert once
            params = scales_as_bytes(params)
            stacked = None if stacked is None else scales_as_bytes(stacked)
            # FP4 codes in the kernel's K order: no column permutation before each matmul. Whole
            # K tiles on one device only (a row-split record would cut them).
            if pallas_tpu_matmul.TILE_RECORDS_FOR_KERNEL and model_axis_size(mesh) == 1:
                params = pallas_tpu_matmul.tile_records_for_kernel(params)
                stacked = None if stacked is None else pallas_tpu_matmul.tile_records_for_kernel(stacked)
        table_format = gathered_table_format(config.compilation.attention_impl, params["embed"])
        if table_format is not None:  # one re-placed table, shared by both trees
            embed = jax.device_put(params["embed"], table_format)
            params = {**params, "embed": embed}
            stacked = None if stacked is None else {**stacked, "embed": embed}
        self.params = params
        # (stacked weights, their compiled scan forwards by step layout) while an unrolled runner's
        # background warm-up runs; one attribute, so a step reads both or neither.
        self._quick: tuple[dict, dict[StepLayout, Any]] | None = None if stacked is None else (stacked, {})
        self.dtype = dtype
        self.page_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_logprobs = config.model.max_logprobs
        self.kv_cache_dtype = jnp.dtype(dtype if kv_cache_dtype is None else kv_cache_dtype)
        # What the cache array holds: the values themselves, or their bytes (an FP8 cache on CPU,
        # which XLA:CPU would copy whole around every fp8 scatter and gather; kv_storage_dtype).
        self.kv_storage_dtype = jnp.dtype(kv_storage_dtype(self.kv_cache_dtype, device.backend))
        self.attn_impl = config.compilation.attention_impl
        # How this engine's programs multiply by its weights: dense, or its quantized records'
        # kernels (a dense engine never meets a record). Active while its programs trace
        # (the fp8 cache's calibration pass below is one).
        self.linears = quant_linear_impls()
        self.kv_scales: tuple[float, float] | None = (
            None if kv_scales is None else (float(kv_scales[0]), float(kv_scales[1]))
        )
        if jnp.dtype(self.kv_cache_dtype).itemsize == 1 and self.kv_scales is None:
            if calibration_tokens is None:
                raise ValueError(
                    f"a {self.kv_cache_dtype} KV cache needs kv_scales or "
                    f"calibration_tokens to measure them from"
                )
            # Before the real cache exists: the calibration cache is small, but not free.
            self.kv_scales = self.calibrate_kv_scales(calibration_tokens)
        # The cache's device format: row-major for the compiled TPU kernel (kv_cache/layout.py says
        # why), else the compiler's choice (None).
        self.kv_format = kv_cache_format(
            self.attn_impl,
            self.kv_storage_dtype,
            self._kv_sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0]),
        )
        self.max_pages_per_seq = math.ceil(max_model_len / self.page_size)
        # Warm-up's compiled forwards by step layout, called directly (no trace on a restart
        # whose executables come from disk); a layout not here goes through the jitted step.
        self._forward_programs: dict[StepLayout, Any] = {}
        self.executable_cache = (
            None
            if executable_cache_dir is None
            else ExecutableCache(executable_cache_dir, self._program_context())
        )
        # The blocked path's work follows the live context, not the table width: one page bucket.
        self.page_buckets = (
            (self.max_pages_per_seq,)
            if self.attn_impl == AttentionImpl.BLOCKED
            else self._page_buckets(self.max_pages_per_seq)
        )
        self.token_buckets = config.token_buckets
        self.seq_buckets = tuple(sorted({min(t, self.max_num_seqs) for t in self.token_buckets}))
        self.max_seq_slots = self.seq_buckets[-1]
        self._traces = 0
        # This engine's sampling programs and their neutral inputs, on its devices (sampler.py).
        # With an executable cache, a restart loads them (and the step glue below) from disk.
        self.sampler = Sampler(self._replicated, self.executable_cache)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self._last_tokens = CachedJit(
            "last-tokens",
            jax.jit(self._traced_last_tokens, static_argnames=("num_slots",)),
            self.executable_cache,
        )
        self._pad_tokens = CachedJit(
            "pad-tokens",
            jax.jit(self._traced_pad_tokens, static_argnames=("num_slots",)),
            self.executable_cache,
        )
        pin: dict[str, Any] = {}  # jax.jit's keyword arguments
        if self.kv_format is not None:
            # In and out in the cache's format, so the donated buffer is updated in place.
            pin = dict(
                in_shardings=(None, self.kv_format, None, None),
                out_shardings=(None, None, None, None, self.kv_format),
            )
        self._step = jax.jit(
            functools.partial(self._traced_step, inv_freq=jnp.asarray(arch.inv_freq())),
            donate_argnums=(1,),
            static_argnums=(4,),
            **pin,
        )
        self.kv_spec: KVCacheSpec | None = None
        self.kv_cache: Any = None  # the cache's device arrays, once allocate_kv_cache() runs
        if num_pages is not None:
            self.allocate_kv_cache(num_pages)
        self._prompt_logits = jax.jit(self._traced_prompt_logits)
        self._no_feed = self._put(np.zeros(self.max_seq_slots, np.int32))
        # The (T, pages_per_seq) pairs steps may use while a background warm-up runs; None: any
        # bucket (what is not compiled yet compiles on the way, as without warm-up).
        self._ready: frozenset[tuple[int, int]] | None = None
        self._ready_lock = threading.Lock()
        self._unrolled_ready: set[tuple[int, int]] = set()  # a background warm-up's, by shape
        self.scan_tier_steps = 0  # steps that ran a quick-tier scan program
        self._unrolled_wanted: set[tuple[int, int]] = set()

    def _cache_spec(self, num_pages: int) -> KVCacheSpec:
        return KVCacheSpec(
            self.arch.num_layers,
            num_pages,
            self.page_size,
            self.arch.num_kv_heads,
            self.arch.head_dim,
            self.kv_storage_dtype,
            num_shards=model_axis_size(self.mesh),
        )

    def allocate_kv_cache(self, num_pages: int) -> None:
        """Allocate the KV cache (once): ``num_pages`` pages in the attention backend's shape
        (the TPU kernel pads the combined-head axis) and device format."""
        if self.kv_cache is not None:
            raise RuntimeError("the KV cache is already allocated")
        self.kv_spec = self._cache_spec(num_pages)
        self.kv_cache = self.kv_spec.allocate(self.attn_impl, self._kv_sharding)

    def step_memory(self) -> dict[str, int]:
        """Device bytes the largest programs of a step need besides weights and cache, from XLA's
        ``memory_analysis()`` of the compiled programs (compiled here on abstract inputs, the cache
        a two-page stand-in). Needs no cache allocated.

        Returns {"forward": temporaries + non-cache outputs of the widest forward (largest token
        and page buckets, drafted when speculating), "prompt_logits": the same for the LM head
        over every row of the widest step}."""
        t, p = self.token_buckets[-1], self.page_buckets[-1]
        batch = self._empty_batch(t, p, self.num_speculative_tokens if t >= 2 else 0)
        # The step updates the cache in place (donated, aliased), so its temporaries do not grow
        # with the cache's pages and two serve. A cache of p + 1 pages put gpt-oss-20b's whole
        # 131k-token cache (12 GiB) into this compile beside 12.8 GiB of weights: over a v5e's
        # HBM, which XLA:TPU refuses at compile time. The cache's own format, as allocated.
        spec = self._cache_spec(RESERVED_PAGE + 2)
        cache = jax.ShapeDtypeStruct(
            spec.shape_for(self.attn_impl), spec.dtype, sharding=self.kv_format or self._kv_sharding
        )
        args = self.step_args(batch, kv_cache=cache)
        fwd = self._compiled("forward", self._step, args)
        hidden = jax.ShapeDtypeStruct((t, self.arch.hidden_size), self.dtype, sharding=self._replicated)
        head = self._compiled("prompt-logits", self._prompt_logits, (self.params, hidden))

        def need(compiled, exclude: int) -> int:
            ma = compiled.memory_analysis()
            if ma is None:  # a backend that cannot say
                return 0
            return int(ma.temp_size_in_bytes) + int(ma.output_size_in_bytes) - exclude

        cache_bytes = int(np.prod(cache.shape)) * jnp.dtype(cache.dtype).itemsize
        # The forward's outputs include the cache it updated in place (aliased, not extra).
        return {"forward": need(fwd, cache_bytes), "prompt_logits": need(head, 0)}

    @staticmethod
    def _page_buckets(max_pages: int) -> tuple[int, ...]:
        out, b = [], 4
        while b < max_pages:
            out.append(b)
            b *= 4
        out.append(max_pages)
        return tuple(sorted(set(out)))

    def _traced_forward(self, params, kv_cache, token_ids, positions, md, logits_indices, *, inv_freq):
        """Model + LM head on the sampled rows. Returns (logits [R, V] f32, hidden [T, H] after the
        final norm (prompt logprobs score its rows later), draft features [T, A] or None, kv_cache)."""
        self._traces += 1  # runs only while tracing, i.e. once per compiled program
        with self.linears.active():
            out = forward(
                params,
                kv_cache,
                token_ids,
                positions,
                md,
                arch=self.arch,
                attn_impl=self.attn_impl,
                inv_freq=inv_freq,
                mesh=self.mesh,
                kv_scales=self.kv_scales,
                kv_dtype=self.kv_cache_dtype,
                aux_layer_ids=self.draft_aux_layers or (),
                expert_parallel=self.expert_parallel,
            )
            logits = compute_logits(params, out.hidden[logits_indices], arch=self.arch)
        hidden, kv_cache = out.hidden, out.kv_cache
        features = None
        if self.draft_aux_layers is not None:
            features = jnp.concatenate(out.aux_hidden, axis=-1) if out.aux_hidden else hidden
        if self.mesh is not None:
            # Pin the cache's sharding so the donated buffer comes back as it went in.
            logits = self._gather_logits(logits)
            hidden = jax.lax.with_sharding_constraint(hidden, self._replicated)
            kv_cache = jax.lax.with_sharding_constraint(kv_cache, self._kv_sharding)
        return logits, hidden, features, kv_cache

    def calibrate_kv_scales(self, token_ids, margin: float | None = None) -> tuple[float, float]:
        """(k_scale, v_scale) of an FP8 KV cache, measured: one prefill of ``token_ids`` (cut to
        max_model_len) into a temporary cache of the model dtype, then the amax of everything
        written there - K after RoPE and V, as the cache would receive them, over all layers and
        heads - through ``kv_scales.scales_from_amax`` (amax / 448 * margin)."""
        ids = np.asarray(token_ids, np.int32)[: self.max_model_len]
        n = len(ids)
        if n == 0:
            raise ValueError("calibration needs at least one token")
        pages = -(-n // self.page_size)
        t_slots = -(-n // 16) * 16
        spec = KVCacheSpec(
            self.arch.num_layers,
            pages + 1,
            self.page_size,
            self.arch.num_kv_heads,
            self.arch.head_dim,
            self.dtype,
            num_shards=model_axis_size(self.mesh),
        )
        cache = spec.allocate(self.attn_impl, self._kv_sharding)
        tokens, positions = np.zeros(t_slots, np.int32), np.zeros(t_slots, np.int32)
        tokens[:n], positions[:n] = ids, np.arange(n, dtype=np.int32)
        put = self._put
        md = AttentionMetadata(
            kv_lens=put(np.asarray([n], np.int32)),
            page_indices=put(np.arange(1, pages + 1, dtype=np.int32)[None]),
            cu_q_lens=put(np.asarray([0, n], np.int32)),
            num_seqs=put(np.asarray([1], np.int32)),
        )

        def amax(params, cache, tokens, positions, md, inv_freq):
            with self.linears.active():
                kv = forward(
                    params,
                    cache,
                    tokens,
                    positions,
                    md,
                    arch=self.arch,
                    attn_impl=self.attn_impl,
                    inv_freq=inv_freq,
                    mesh=self.mesh,
                    expert_parallel=self.expert_parallel,
                ).kv_cache
            # K and V as the cache's layout holds them (interleaved heads, or K | V lanes of a
            # lane-packed row); padding and unwritten rows are zeros, which never raise an amax.
            k, v = split_kv(kv, head_dim=self.arch.head_dim)
            return jnp.max(jnp.abs(k.astype(jnp.float32))), jnp.max(jnp.abs(v.astype(jnp.float32)))

        k_amax, v_amax = jax.jit(amax)(
            self.params, cache, put(tokens), put(positions), md, jnp.asarray(self.arch.inv_freq())
        )
        k_amax, v_amax = float(k_amax), float(v_amax)
        del cache
        if not (np.isfinite(k_amax) and np.isfinite(v_amax)):
            raise ValueError(
                f"KV cache calibration measured a non-finite amax "
                f"(K {k_amax}, V {v_amax}): the model's activations overflow"
            )
        scales = ks.scales_from_amax(k_amax, v_amax, ks.MARGIN if margin is None else margin)
        log.info(
            "FP8 KV cache: calibrated over %d tokens: K amax %.4g, V amax %.4g -> k_scale %.6g, v_scale %.6g",
            n,
            k_amax,
            v_amax,
            *scales,
        )
        return scales

    def _traced_step(self, params, kv_cache, packed, prev_tokens, layout: StepLayout, *, inv_freq):
        """(logits [R, V], argmax [R], hidden [T, H], features, kv_cache) of one step whose int32
        inputs arrive packed (``StepLayout``)."""
        token_ids, feed_rows, positions, md, logits_indices = layout.unpack(packed)
        # Async scheduling: rows the host could not fill yet take the previous step's token here.
        token_ids = jnp.where(feed_rows >= 0, prev_tokens[jnp.maximum(feed_rows, 0)], token_ids)
        logits, hidden, features, kv_cache = self._traced_forward(
            params, kv_cache, token_ids, positions, md, logits_indices, inv_freq=inv_freq
        )
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        # Also padded as the next step's feed source, when R fits the slots (R = S without drafts).
        rows = greedy.shape[0]
        greedy_last = None
        if rows <= self.max_seq_slots:
            greedy_last = jnp.zeros(self.max_seq_slots, jnp.int32).at[:rows].set(greedy)
        return logits, (greedy, greedy_last), hidden, features, kv_cache

    def _traced_prompt_logits(self, params, hidden):
        """Logits of every row of a step, rows padded to the logprob bucket: [B, V] f32."""
        self._traces += 1
        rows = logprob_rows_bucket(hidden.shape[0])
        hidden = jnp.pad(hidden, ((0, rows - hidden.shape[0]), (0, 0)))
        with self.linears.active():
            logits = compute_logits(params, hidden, arch=self.arch)
        return logits if self.mesh is None else self._gather_logits(logits)

    def _traced_last_tokens(self, token_ids, num_accepted, *, num_slots: int):
        self._traces += 1  # the step glue (runs only while tracing)
        return _last_tokens(token_ids, num_accepted, num_slots=num_slots)

    def _traced_pad_tokens(self, token_ids, *, num_slots: int):
        self._traces += 1
        return _pad_tokens(token_ids, num_slots=num_slots)

    def _gather_logits(self, logits):
        """[R, V] logits of a vocabulary-parallel LM head -> replicated, for the sampler.

        Pinning the head's output to its vocabulary split first makes XLA all-gather the R x V
        logits; asked only for a replicated result it may gather the H x V head instead.
        """
        split = NamedSharding(self.mesh, P(None, MODEL_AXIS))
        logits = jax.lax.with_sharding_constraint(logits, split)
        return jax.lax.with_sharding_constraint(logits, self._replicated)

    @property
    def compile_count(self) -> int:
        """Programs traced so far by this runner: model forward variants, step glue, and its
        sampler's and rejection sampler's variants."""
        return self._traces + self.sampler.compile_count() + self.rejection_sampler.compile_count()

    def _put(self, x) -> jax.Array:
        """A host array as a step input: on the default device, or replicated over the mesh."""
        return jnp.asarray(x) if self._replicated is None else place(x, self._replicated)

    # ---- building a padded batch ----

    def build_batch(self, seqs: list[ScheduledSeq]) -> StepBatch:
        """Pad a list of per-sequence work items into a StepBatch of bucketed shapes.

        One pass over the sequences collects their lists; the padded arrays are then filled with
        whole-array numpy ops (a per-sequence loop of small numpy writes cost a batch of 128
        decodes ~3 ms of host time a step, more than the device's share of a small model's step).
        """
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        num = len(seqs)
        # The flags ride in the same pass: a separate any() over the items per flag costs more.
        meta = np.array(
            [
                (
                    len(s.token_ids),
                    len(s.draft_token_ids),
                    len(s.page_ids),
                    s.num_computed,
                    s.feed_from,
                    s.prompt_logprob_targets is not None and len(s.prompt_logprob_targets) > 0,
                    s.draft_bitmasks is not None,
                )
                for s in seqs
            ],
            np.int64,
        )
        n_tok, n_draft, n_page, computed, feed_from, has_targets, has_masks = meta.T
        any_targets, any_draft_masks = bool(has_targets.any()), bool(has_masks.any())
        per_seq = n_tok + n_draft
        num_tokens = int(per_seq.sum())
        t_slots, pages_per_seq = self.step_shape(num_tokens, int(n_page.max()))
        s_slots = min(t_slots, self.max_num_seqs)
        if num > s_slots:
            raise ValueError(f"{num} sequences exceed the {s_slots} slots of a {t_slots}-token step")
        max_drafts = int(n_draft.max())
        k_slots = self._draft_slots(max_drafts)
        # Without drafts every sequence has one logits row: R = S. With drafts each has at most
        # 1 + K rows and the step at most T, so R = min(T, S * (1 + K)): one R per (T, K).
        r_slots = self._logits_slots(t_slots, k_slots)
        self._check_items(seqs, n_tok, n_draft, n_page, computed + per_seq, any_draft_masks)

        ends = np.cumsum(per_seq)
        starts = ends - per_seq
        token_ids = np.zeros(t_slots, np.int32)
        positions = np.zeros(t_slots, np.int32)
        if max_drafts:
            flat = itertools.chain.from_iterable(
                itertools.chain(s.token_ids, s.draft_token_ids) for s in seqs
            )
        else:
            flat = itertools.chain.from_iterable(s.token_ids for s in seqs)
        token_ids[:num_tokens] = np.fromiter(flat, np.int32, num_tokens)
        # Token j of sequence i sits at position num_computed[i] + (j - starts[i]).
        positions[:num_tokens] = np.arange(num_tokens) + np.repeat(computed - starts, per_seq)
        kv_lens = np.zeros(s_slots, np.int32)
        kv_lens[:num] = computed + per_seq
        page_table = np.full((s_slots, pages_per_seq), RESERVED_PAGE, np.int32)
        total_pages = int(n_page.sum())
        page_rows = np.repeat(np.arange(num), n_page)
        page_cols = np.arange(total_pages) - np.repeat(np.cumsum(n_page) - n_page, n_page)
        page_table[page_rows, page_cols] = np.fromiter(
            itertools.chain.from_iterable(s.page_ids for s in seqs), np.int32, total_pages
        )
        cu = np.zeros(s_slots + 1, np.int32)
        cu[1 : num + 1] = ends
        cu[num + 1 :] = num_tokens
        # Logits rows: the last computed token of each sequence, then one per draft.
        rows_per_seq = n_draft + 1
        row_ends = np.cumsum(rows_per_seq)
        num_rows = int(row_ends[-1])
        cu_logits = np.zeros(s_slots + 1, np.int32)
        cu_logits[1 : num + 1] = row_ends
        cu_logits[num + 1 :] = num_rows
        logits_indices = np.zeros(r_slots, np.int32)
        logits_indices[:num_rows] = np.arange(num_rows) + np.repeat(
            starts + n_tok - 1 - (row_ends - rows_per_seq), rows_per_seq
        )
        drafts = np.full((s_slots, k_slots), -1, np.int32)
        feed_rows = None
        feeds = feed_from >= 0
        if feeds.any():
            feed_rows = np.full(t_slots, -1, np.int32)
            feed_rows[starts[feeds]] = feed_from[feeds]
        pl_rows: list[int] = []
        pl_targets: list[int] = []
        pl_k = 0
        if max_drafts or any_targets:
            for i, s in enumerate(seqs):
                drafts[i, : n_draft[i]] = s.draft_token_ids
                if s.prompt_logprob_targets:
                    off, m = int(starts[i]), len(s.prompt_logprob_targets)
                    pl_rows.extend(range(off, off + m))
                    pl_targets.extend(s.prompt_logprob_targets)
                    pl_k = max(pl_k, s.num_prompt_logprobs)
        sampling = pack_sampling_rows([s.sampling for s in seqs], s_slots, self.arch.vocab_size)
        row_bitmask = None
        if any_draft_masks:
            row_bitmask = np.full((r_slots, (self.arch.vocab_size + 31) // 32), -1, np.int32)
            for i, s in enumerate(seqs):
                if s.draft_bitmasks is not None:
                    row_bitmask[cu_logits[i] : cu_logits[i + 1]] = s.draft_bitmasks
                elif s.sampling.token_bitmask is not None:
                    row_bitmask[cu_logits[i] : cu_logits[i + 1]] = s.sampling.token_bitmask
        return StepBatch(
            token_ids=token_ids,
            positions=positions,
            cu_q_lens=cu,
            kv_lens=kv_lens,
            page_table=page_table,
            num_seqs=num,
            num_tokens=num_tokens,
            logits_indices=logits_indices,
            cu_logits=cu_logits,
            draft_token_ids=drafts,
            sampling=sampling,
            feed_rows=feed_rows,
            prompt_logprob_rows=np.asarray(pl_rows, np.int32) if pl_rows else None,
            prompt_logprob_targets=np.asarray(pl_targets, np.int32) if pl_rows else None,
            num_prompt_logprobs=pl_k,
            row_bitmask=row_bitmask,
        )

    def _check_items(
        self,
        seqs: list[ScheduledSeq],
        n_tok: np.ndarray,
        n_draft: np.ndarray,
        n_page: np.ndarray,
        kv_lens: np.ndarray,
        any_draft_masks: bool,
    ) -> None:
        """The per-sequence invariants ``build_batch`` relies on, checked over whole arrays (the
        loops run only to name the first offender or when drafts are present)."""
        bad_pages = n_page * self.page_size < kv_lens
        if (n_tok == 0).any() or bad_pages.any():
            for i in range(len(seqs)):
                if n_tok[i] == 0:
                    raise ValueError("a scheduled sequence must compute at least one token")
                if bad_pages[i]:
                    raise ValueError(f"sequence {i}: {n_page[i]} pages cannot hold {kv_lens[i]} tokens")
        if not n_draft.any() and not any_draft_masks:
            return
        for i, s in enumerate(seqs):
            k = int(n_draft[i])
            if k and s.sampling.token_bitmask is not None and s.draft_bitmasks is None:
                raise ValueError(
                    "drafts under a grammar need draft_bitmasks: each verification row "
                    "has the mask of the grammar state after the drafts before it"
                )
            if s.draft_bitmasks is not None and len(s.draft_bitmasks) != k + 1:
                raise ValueError(
                    f"sequence {i}: {len(s.draft_bitmasks)} draft_bitmasks rows for {k} drafts (want {k + 1})"
                )

    def step_shape(self, num_tokens: int, num_pages: int) -> tuple[int, int]:
        """(T, pages_per_seq) of a step of ``num_tokens`` tokens whose longest sequence holds
        ``num_pages`` pages: the smallest buckets that fit, among the compiled ones while a
        background warm-up runs (a larger bucket pads the step: slower, never a compile)."""
        ready = self._ready
        if ready is None:
            return _bucket(num_tokens, self.token_buckets), _bucket(num_pages, self.page_buckets)
        fits = [(t, p) for t, p in ready if t >= num_tokens and p >= num_pages]
        if not fits:
            raise ValueError(
                f"no compiled step shape holds {num_tokens} tokens and {num_pages} pages yet "
                f"(largest ready step: {self.max_ready_tokens()} tokens); the scheduler's token "
                f"budget must follow max_ready_tokens()"
            )
        return min(fits)

    @property
    def holds_scan_tier(self) -> bool:
        """Whether the quick tier's stacked weights are still held (warm-up not done)."""
        return self._quick is not None

    def max_ready_tokens(self) -> int:
        """The largest step that runs without compiling: the largest token bucket compiled with
        the widest page table (every bucket when no background warm-up runs)."""
        ready = self._ready
        if ready is None:
            return self.token_buckets[-1]
        widest = self.page_buckets[-1]
        return max((t for t, p in ready if p == widest), default=0)

    def page_bucket(self, num_pages: int) -> int:
        """The page-table width a sequence of ``num_pages`` pages is padded to."""
        return _bucket(num_pages, self.page_buckets)

    def _draft_slots(self, max_drafts: int) -> int:
        """K of a batch whose longest draft list has ``max_drafts`` tokens (0: nothing speculated)."""
        if max_drafts == 0:
            return 0
        if max_drafts <= self.num_speculative_tokens:
            return self.num_speculative_tokens  # the one K warm-up compiled
        return 1 << (max_drafts - 1).bit_length()

    def _logits_slots(self, t_slots: int, k_slots: int) -> int:
        """R of a step with T = t_slots and K = k_slots."""
        s_slots = min(t_slots, self.max_num_seqs)
        return s_slots if k_slots == 0 else min(t_slots, s_slots * (1 + k_slots))

    # ---- running ----

    def step_args(self, batch: StepBatch, prev: PendingStep | None = None, kv_cache=None) -> tuple:
        """The forward program's arguments for ``batch``: the int32 inputs packed into one
        host->device copy, then their (static) layout. ``kv_cache`` stands in for the runner's own
        (an abstract one to lower without a cache)."""
        if batch.feed_rows is not None and prev is None:
            raise ValueError("the batch feeds tokens from a previous step, but none was given")
        feed = batch.feed_rows if batch.feed_rows is not None else np.full(len(batch.token_ids), -1, np.int32)
        layout = StepLayout.of(batch)
        prev_tokens = prev.last_tokens if prev is not None else self._no_feed
        cache = self.kv_cache if kv_cache is None else kv_cache
        return (self.params, cache, self._put(layout.pack(batch, feed)), prev_tokens, layout)

    def forward(self, batch: StepBatch, prev: PendingStep | None = None) -> ForwardState:
        """Dispatch the model over ``batch`` (returns before the device finishes).

        ``prev`` is the still-running step whose tokens ``batch.feed_rows`` refer to.
        """
        args = self.step_args(batch, prev)
        # Read before the unrolled programs: the quick tier is released only once they all exist.
        quick = self._quick
        if quick is not None and self._ready is None:
            # no background warm-up (none started, or a foreground one): the quick tier has no use
            quick = self._quick = None
        program = self._forward_programs.get(args[-1])
        if program is None and quick is not None and args[-1] in quick[1]:
            program, args = quick[1][args[-1]], (quick[0], *args[1:])
            self.scan_tier_steps += 1
        if program is not None:
            logits, (greedy, greedy_last), hidden, features, self.kv_cache = program(*args[:-1])
        else:
            logits, (greedy, greedy_last), hidden, features, self.kv_cache = self._step(*args)
        return ForwardState(batch, logits, hidden, features, greedy, greedy_last)

    def step_hlo(self, batch: StepBatch) -> str:
        """The optimized HLO text of the forward program ``batch`` runs (compiles it if needed):
        what ``collectives.collectives`` reads the communication of a sharded step from."""
        batch = dataclasses.replace(batch, feed_rows=None)
        args = self.step_args(batch)
        text = self._step.lower(*args).compile().as_text()
        assert text is not None  # None only from a backend that cannot print its programs
        return text

    def sample(
        self, fwd: ForwardState, sampling: SamplingBatch | None = None, draft_probs: jax.Array | None = None
    ) -> PendingStep:
        """Dispatch sampling (and draft verification) over a forward's logits.

        ``sampling`` replaces the batch's own (the vLLM worker adds the grammar bitmask here).
        draft_probs [S, K, V]: the draft distributions of the batch's drafts (a drafter that samples,
        e.g. EAGLE with probabilistic drafting); None verifies them as one-hot drafts (n-gram,
        greedy drafters).
        """
        batch = fwd.batch
        sampling = sampling if sampling is not None else batch.sampling
        rows = _expand_rows(sampling, batch.cu_logits, fwd.logits.shape[0], batch.draft_token_ids)
        if batch.row_bitmask is not None and sampling is batch.sampling:
            rows = dataclasses.replace(rows, token_bitmask=batch.row_bitmask)
        if batch.draft_token_ids.shape[1] == 0:
            token_ids, lp_parts = self.sampler.sample_async(
                fwd.logits, rows, self.max_logprobs, greedy=fwd.greedy
            )
            accepted = None
        else:
            v = self.rejection_sampler.verify_async(
                fwd.logits,
                rows,
                batch.draft_token_ids,
                batch.cu_logits,
                draft_probs,
                max_logprobs=self.max_logprobs,
            )
            token_ids, accepted, lp_parts = v.token_ids, v.num_accepted, v.logprobs
        prompt_parts = None
        if batch.prompt_logprob_rows is not None:
            # Every row of the step is scored (one program per token bucket); the host keeps the
            # rows that have prompt targets.
            targets = np.zeros(len(batch.token_ids), np.int32)
            assert batch.prompt_logprob_targets is not None  # given with the rows
            targets[batch.prompt_logprob_rows] = batch.prompt_logprob_targets
            prompt_parts = self.sampler.compute_logprobs_async(
                self._prompt_logits(self.params, fwd.hidden), targets, self.max_logprobs
            )
        if accepted is None and token_ids is fwd.greedy and fwd.greedy_last is not None:
            last = fwd.greedy_last
        elif accepted is None:
            last = self._pad_tokens(token_ids, num_slots=self.max_seq_slots)
        else:
            last = self._last_tokens(token_ids, accepted, num_slots=self.max_seq_slots)
        return PendingStep(
            batch.num_seqs, token_ids, accepted, last, lp_parts, prompt_parts, batch.prompt_logprob_rows
        )

    @staticmethod
    def fetch(step: PendingStep) -> StepOutput:
        """Wait for a dispatched step and copy its results to the host."""

        def lp(parts, rows=None):
            if parts is None:
                return None
            a, b, c, d = (np.asarray(p) if rows is None else np.asarray(p)[rows] for p in parts)
            return Logprobs(token_logprobs=a, token_ranks=b, top_ids=c, top_logprobs=d)

        if step.num_accepted is None:  # one token per row
            token_ids = np.asarray(step.token_ids)[:, None]
            accepted = np.zeros(len(token_ids), np.int32)
        else:
            token_ids, accepted = jax.device_get((step.token_ids, step.num_accepted))
        return StepOutput(
            token_ids=token_ids,
            num_accepted=accepted,
            logprobs=lp(step.logprobs),
            prompt_logprobs=lp(step.prompt_logprobs, step.prompt_logprob_rows),
        )

    def execute(self, batch: StepBatch) -> StepOutput:
        """One step, synchronously."""
        return self.fetch(self.sample(self.forward(batch)))

    def compute_logits(self, batch: StepBatch) -> np.ndarray:
        """Logits [num_seqs, V] of each sequence's last scheduled token (tests, debugging); updates the cache."""
        return np.asarray(self.forward(batch).logits)[: batch.num_seqs]

    def warmup(self, *, workers: int | None = None, progress: bool = False) -> int:
        """Compile every (token bucket, page bucket) forward, every sampler variant at every sequence
        bucket, and the step glue; with num_speculative_tokens > 0 also the drafted forward of every
        (T, pages) pair, the sampler at every drafted row count, and the verification programs.
        Compiles on ``workers`` threads (None: one per core). Returns the number of programs traced."""
        before = self.compile_count
        self._quick = None  # every unrolled program compiles before a step runs: no quick tier
        warm = self.start_warmup(workers=workers, progress=progress)
        warm.wait()
        if warm.failed:
            key, err = next(iter(warm.failed.items()))
            raise RuntimeError(f"warm-up: compiling {key} failed: {type(err).__name__}: {err}") from err
        log.info("warm-up compiled %d programs in %.1f s", self.compile_count - before, warm.seconds)
        return self.compile_count - before

    def start_warmup(
        self, *, workers: int | None = None, progress: bool = True, plan: WarmupPlan | None = None
    ) -> Warmup:
        """Start compiling ``plan`` (None: ``warmup_plan()``) on a thread pool and return it
        running. From here on steps use only the (T, pages_per_seq) pairs compiled so far;
        ``Warmup.wait_first()`` returns once the first ones are. Call from the thread that runs
        steps, between steps."""
        plan = plan or self.warmup_plan()
        with self._ready_lock:
            self._ready = frozenset()
            self._unrolled_ready = set()
            shapes = [cast(tuple, g.shape) for g in plan.groups]
            self._unrolled_wanted = {cast(tuple[int, int], s) for s in shapes if len(s) == 2}
        return Warmup(plan, self._mark_ready, workers=workers, progress=progress)

    def _mark_ready(self, shape: Hashable) -> None:
        # warmup_plan()'s groups: (T, pages_per_seq), or (T, pages_per_seq, "scan") for the quick tier
        group = cast(tuple, shape)
        step_shape = cast(tuple[int, int], group[:2])
        with self._ready_lock:  # called from the compile threads
            self._ready = (self._ready or frozenset()) | {step_shape}
            if len(group) == 2:
                self._unrolled_ready.add(step_shape)
                if self._unrolled_ready >= self._unrolled_wanted and self._quick is not None:
                    # every shape has its unrolled program: drop the stacked weights (forward says
                    # why this order is safe)
                    self._quick = None
                    log.info(
                        "warm-up: every unrolled forward is ready; the scan tier ran %d steps",
                        self.scan_tier_steps,
                    )

    def warmup_plan(self) -> WarmupPlan:
        """Every program a step can run, as independent compile tasks, grouped by the
        (T, pages_per_seq) step shape they serve, most wanted first:

        first   (smallest T, widest pages) for decode and (the T of a FIRST_PROMPT_TOKENS prompt,
                widest pages) for a short prefill: the widest page table fits any sequence, so a
                first request of any length runs (a longer prompt in chunks of that T)
        then    each T ascending, widest pages first, then the narrower page tables (which only
                save attention work): most steps are decodes of a few sequences.

        With the quick tier (an unrolled runner that can scan), the first shapes also get a group
        ``(T, pages, "scan")`` of the same forwards as a layer scan, and those are the first groups:
        a step of that shape runs as soon as either program is ready. Only the first shapes: the
        scan programs are extra compiles, and the first two already serve any request (padded or
        in chunks) until the unrolled ones come, smallest first.

        A forward compiles ahead of time (``lower().compile()`` on the cache's abstract shape;
        the later call finds it in jax's in-memory cache); the sampler programs run once on zero
        logits, which also compiles the small eager ops of ``sample``. No task touches the KV
        cache or any other state a running step uses."""
        k = self.num_speculative_tokens
        kv = self.kv_cache  # read here, on the stepping thread: steps replace it (donated)
        cache = jax.ShapeDtypeStruct(kv.shape, kv.dtype, sharding=self._kv_sharding)
        widest = self.page_buckets[-1]
        tasks: dict[str, CompileTask] = {}

        def task(key: str, fn, *args) -> str:
            if key not in tasks:
                tasks[key] = CompileTask(key, functools.partial(fn, *args))
            return key

        quick = self._quick is not None
        prompt_t = next((t for t in self.token_buckets if t >= FIRST_PROMPT_TOKENS), self.token_buckets[-1])
        first = {(self.token_buckets[0], widest), (prompt_t, widest)}
        groups = []
        for t in self.token_buckets:
            s_slots = min(t, self.max_num_seqs)
            shared = [
                task(f"sampler rows={s_slots}", self._warm_sampler, t, 0),
                task(f"prompt logits t={t}", self._warm_prompt_logits, t),
            ]
            if k and t >= 2:  # a drafted step holds at least a token and a draft
                r = self._logits_slots(t, k)
                shared.append(task(f"verify rows={r} seqs={s_slots} k={k}", self._warm_sampler, t, k))
            for p in self.page_buckets:
                for scan in (True, False) if quick and (t, p) in first else (False,):
                    name = "scan forward" if scan else "forward"
                    keys = [task(f"{name} t={t} p={p}", self._compile_forward, cache, t, p, 0, scan)]
                    if k and t >= 2:
                        keys.append(
                            task(f"{name} t={t} p={p} k={k}", self._compile_forward, cache, t, p, k, scan)
                        )
                    groups.append(((t, p, "scan") if scan else (t, p), tuple(keys + shared)))

        def rank(shape: tuple) -> tuple:
            t, p = shape[:2]
            return (len(shape) == 2, (t, p) not in first, t, p != widest, p)

        groups.sort(key=lambda g: rank(g[0]))
        return WarmupPlan(
            tasks=tuple(tasks.values()),
            groups=tuple(
                ShapeGroup(shape, keys, first=shape[:2] in first and (len(shape) == 3) == quick)
                for shape, keys in groups
            ),
        )

    def _compile_forward(
        self, cache: jax.ShapeDtypeStruct, t_slots: int, pages_per_seq: int, k_slots: int, scan: bool = False
    ) -> None:
        """Compile the forward of one step shape ahead of time, for the cache's abstract shape
        (feeds travel as fixed-shape operands: the same program serves fed and plain steps);
        ``scan``: the quick tier's, over the stacked weights."""
        batch = self._empty_batch(t_slots, pages_per_seq, k_slots)
        args = self.step_args(batch, kv_cache=cache)
        if not scan:
            self._forward_programs[args[-1]] = self._compiled("forward", self._step, args)
            return
        quick = self._quick
        if quick is not None:  # None: released, every unrolled forward is ready
            quick[1][args[-1]] = self._compiled("forward-scan", self._step, (quick[0], *args[1:]))

    def _compiled(self, name: str, jitted, args: tuple):
        """``jitted.lower(*args).compile()``, through the executable cache when there is one."""
        disk = self.executable_cache
        if disk is None:
            return jitted.lower(*args).compile()
        return disk.compiled(name, jitted, args)

    def _program_context(self) -> str:
        """What a forward's trace closes over besides its arguments (the executable cache's key)."""
        # the devices by id: data-parallel replicas share a mesh shape, not devices, and an
        # executable runs on the devices it was compiled for
        mesh = None if self.mesh is None else (self.mesh.axis_names, [d.id for d in self.mesh.devices.flat])
        # the TPU kernel reads its generation's block sizes at trace time (a benchmark A/B swaps them)
        tpu_kernel = self.attn_impl in (AttentionImpl.PALLAS_TPU, AttentionImpl.PALLAS_TPU_INTERPRET)
        return "\n".join(
            repr(x)
            for x in (
                self.config,
                self.arch,
                self.attn_impl,
                self.layer_loop,
                self.dtype,
                self.kv_cache_dtype,
                self.kv_storage_dtype,
                self.kv_scales,
                self.num_speculative_tokens,
                self.draft_aux_layers,
                self.max_model_len,
                mesh,
                generation_block_sizes() if tpu_kernel else None,
            )
        )

    def _warm_sampler(self, t_slots: int, k_slots: int) -> None:
        """The sampling half of a step of T = t_slots (K = k_slots drafts) on zero logits: the
        path ``sample`` takes (glue and eager ops included), then every sampler variant at its row
        count, and the verification programs when drafted."""
        batch = self._empty_batch(t_slots, self.page_buckets[0], k_slots)
        r_slots = self._logits_slots(t_slots, k_slots)
        logits = place(np.zeros((r_slots, self.arch.vocab_size), np.float32), self._replicated)
        # A forward always hands ``sample`` its argmax, so a plain step needs no argmax program of
        # its own; draft verification (k_slots > 0) takes the sampler's greedy path, which does.
        greedy = None if k_slots else place(np.zeros(r_slots, np.int32), self._replicated)
        state = ForwardState(batch, logits, None, greedy=greedy)  # type: ignore[arg-type]  # sample() reads no hidden
        jax.block_until_ready(self.sample(state).last_tokens)
        self.sampler.warmup([r_slots], self.arch.vocab_size, self.max_logprobs, argmax=bool(k_slots))
        if k_slots:
            s_slots = min(t_slots, self.max_num_seqs)
            self.rejection_sampler.warmup([(r_slots, s_slots, k_slots)], self.arch.vocab_size)

    def _warm_prompt_logits(self, t_slots: int) -> None:
        """Prompt logprobs of a T-token step: the LM head over every row (compiled ahead of time:
        running it would cost a [T, V] matmul), then the logprobs of its padded rows."""
        hidden = jax.ShapeDtypeStruct((t_slots, self.arch.hidden_size), self.dtype, sharding=self._replicated)
        self._prompt_logits.lower(self.params, hidden).compile()
        rows = logprob_rows_bucket(t_slots)
        logits = place(np.zeros((rows, self.arch.vocab_size), np.float32), self._replicated)
        self.sampler.compute_logprobs(logits, np.zeros(rows, np.int32), 0, self.max_logprobs)

    def _empty_batch(self, t_slots: int, pages_per_seq: int, k_slots: int = 0) -> StepBatch:
        """A batch of bucket shape with no sequences (and K = k_slots draft slots): nothing is
        written or attended."""
        s_slots = min(t_slots, self.max_num_seqs)
        return StepBatch(
            token_ids=np.zeros(t_slots, np.int32),
            positions=np.zeros(t_slots, np.int32),
            cu_q_lens=np.zeros(s_slots + 1, np.int32),
            kv_lens=np.zeros(s_slots, np.int32),
            page_table=np.zeros((s_slots, pages_per_seq), np.int32),
            num_seqs=0,
            num_tokens=0,
            logits_indices=np.zeros(self._logits_slots(t_slots, k_slots), np.int32),
            cu_logits=np.zeros(s_slots + 1, np.int32),
            draft_token_ids=np.full((s_slots, k_slots), -1, np.int32),
            sampling=pack_sampling_rows([], s_slots, self.arch.vocab_size),
        )


# ---- step glue: small helpers between the model and the sampler (the runner jits them) ----


def _last_tokens(token_ids, num_accepted, *, num_slots: int):
    """[S, K+1], [S] -> [num_slots]: each sequence's last new token, padded to a fixed width so the
    next step's program does not depend on this step's shape."""
    last = jnp.take_along_axis(token_ids, num_accepted[:, None], axis=1)[:, 0]
    return jnp.zeros(num_slots, jnp.int32).at[: last.shape[0]].set(last)


def _pad_tokens(token_ids, *, num_slots: int):
    """[S] -> [num_slots]: one new token per sequence, padded like ``_last_tokens``'s output."""
    return jnp.zeros(num_slots, jnp.int32).at[: token_ids.shape[0]].set(token_ids)


def _expand_rows(
    sampling: SamplingBatch, cu_logits: np.ndarray, num_rows: int, drafts: np.ndarray | None = None
) -> SamplingBatch:
    """Per-sequence sampling params -> one row per logits row (the identity without drafts).

    A sequence's j-th row samples token index ``step + j``: each position keeps its own key, and
    its penalties count drafts 0..j-1 as output (they precede that token if the row is reached).
    drafts [S, K] i32 (-1 pads).
    """
    counts = np.diff(cu_logits)
    if len(counts) == num_rows and (counts <= 1).all():
        return sampling
    src = np.repeat(np.arange(len(counts)), counts)
    offs = np.arange(len(src)) - np.repeat(cu_logits[:-1], counts)
    pad = num_rows - len(src)
    src = np.concatenate([src, np.full(pad, len(counts) - 1)]).astype(np.int64)

    def take(a):
        return None if a is None else a[src]

    out = SamplingBatch(
        **{
            name: take(getattr(sampling, name))
            for name in (
                "temperature",
                "top_k",
                "top_p",
                "min_p",
                "seeds",
                "steps",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "output_counts",
                "prompt_mask",
                "banned_ids",
                "token_bitmask",
            )
        },
        num_logprobs=sampling.num_logprobs,
    )
    out.steps = out.steps + np.concatenate([offs, np.zeros(pad, np.int64)]).astype(np.int32)
    if out.output_counts is not None and drafts is not None:
        real = np.arange(len(offs))
        for j in range(1, drafts.shape[1] + 1):
            r = real[offs >= j]
            ids = drafts[src[r], j - 1]
            np.add.at(out.output_counts, (r[ids >= 0], ids[ids >= 0]), 1)
    return out


# The quick tier keeps a second copy of the layers during warm-up; only when it is at most this
# share of the host's memory.
QUICK_TIER_MEMORY_SHARE = 0.25


def _scannable(params: dict, arch: ModelArch) -> bool:
    """Whether a layer scan can run these weights: stacked layers (not a list of differing ones)
    with one sliding window, read whole (not a multi-host load's per-slice sources)."""
    if isinstance(params["layers"], (list, tuple)):
        return False
    if len({arch.layer_window(i) for i in range(arch.num_layers)}) > 1:
        return False
    return not any(isinstance(a, HostSource) for a in jax.tree.leaves(params["layers"]))

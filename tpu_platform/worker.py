"""``Worker``: one model on one device, built the same way for every front end.

The standalone engine, the vLLM worker and the SGLang executor each build one; they differ only in
who decides the number of KV pages (our engine from the config, vLLM from the bytes this worker
reports, SGLang from ``--max-total-tokens``). Steps, in the order vLLM calls them:

    w = Worker(config)            device discovery, XLA cache, dtype
    w.load()                      weights (HF safetensors or GGUF), tokenizer, context length
    w.kv_cache_budget()           bytes the KV cache may take  (the one sizing formula; on an
                                  accelerator the memory plan measures the step programs first)
    w.num_pages()                 pages that budget holds, capped by what the scheduler can use
    w.init_kv_cache(num_pages)    the ModelRunner: weights + KV pages on the device
    w.warmup()                    compile every shape bucket (or w.start_warmup(): the first
                                  ones, the rest in the background)
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from tpuserve.attention.kv_cache_shape import min_page_size
from tpuserve.kv_cache.layout import KVCacheSpec
from tpuserve.tpu_platform import kv_scales
from tpuserve.tpu_platform.config import (
    FP8_KV_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    ConfigError,
    EngineConfig,
    QuantCalibration,
    SpecMethod,
    SpeculativeConfig,
)
from tpuserve.tpu_platform.device import (
    HostSource,
    discover,
    enable_compilation_cache,
    place,
    read_whole,
    resolve_dtype,
)
from tpuserve.tpu_platform.draft_runner import DraftRunner
from tpuserve.tpu_platform.loader import load_model
from tpuserve.tpu_platform.loader.draft_head import load_draft
from tpuserve.tpu_platform.mesh import MODEL_AXIS, mesh_devices, model_axis_size, plan_devices, replica_mesh
from tpuserve.tpu_platform.model_runner import ModelRunner
from tpuserve.tpu_platform.models import calibrate
from tpuserve.tpu_platform.models.arch import ModelArch, ModelConfigError
from tpuserve.tpu_platform.models.draft_head import DraftHead
from tpuserve.tpu_platform.models.quantize import QuantReport, quantize_params
from tpuserve.tpu_platform.models.sharding import (
    check_expert_parallel,
    check_tensor_parallel,
    group_gate_up_by_device,
    group_gate_up_records_by_device,
    param_partition_specs,
    replicate_kv_heads,
)
from tpuserve.tpu_platform.startup_timing import StartupTimings
from tpuserve.tpu_platform.warmup import Warmup

log = logging.getLogger(__name__)

# Default KV budget on a CPU host: its RAM is shared with everything else on the machine.
CPU_KV_CACHE_BYTES = 1 << 30
# Kept free on an accelerator besides what the profiled step programs need: the sampler's
# temporaries (a few f32 copies of the [S, V] logits) and a slack for the allocator and small
# programs, as a fraction of device memory.
_LOGITS_COPIES = 4
_MARGIN_FRACTION = 0.02
_GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryPlan:
    """How an accelerator's memory is split (bytes); ``kv_cache`` is what is left for pages."""

    device: int
    usable: int  # gpu_memory_utilization x device
    weights: int
    forward: int  # temporaries + non-cache outputs of the widest forward program (measured)
    lm_head: int  # the same for the prompt-logprobs LM head program (measured)
    sampler: int  # sampler allowance: _LOGITS_COPIES x [max_num_seqs, V] f32
    margin: int

    @property
    def activations(self) -> int:
        return max(self.forward, self.lm_head) + self.sampler + self.margin

    @property
    def kv_cache(self) -> int:
        return self.usable - self.weights - self.activations

    def describe(self) -> str:
        return (
            f"{self.usable / _GIB:.2f} GiB usable of {self.device / _GIB:.2f}: weights "
            f"{self.weights / _GIB:.2f}, activations {self.activations / _GIB:.2f} (forward "
            f"{self.forward / _GIB:.2f}, LM head {self.lm_head / _GIB:.2f}, sampler "
            f"{self.sampler / _GIB:.2f}, margin {self.margin / _GIB:.2f}), KV cache "
            f"{self.kv_cache / _GIB:.2f}"
        )


def plan_memory(
    config: EngineConfig, *, memory_bytes: int, weight_bytes: int, step_bytes: dict[str, int], vocab_size: int
) -> MemoryPlan:
    """The accelerator memory plan: ``gpu_memory_utilization`` of ``memory_bytes``, less the
    weights, less what the step programs measured (``ModelRunner.step_memory``) plus the sampler
    allowance and a margin, is the KV cache's. ConfigError naming the numbers and the flags to
    change when the weights alone, or weights and activations, do not fit."""
    cache, sched = config.cache, config.scheduler
    util = cache.gpu_memory_utilization
    usable = int(util * memory_bytes)
    if weight_bytes >= usable:
        raise ConfigError(
            f"gpu_memory_utilization: the weights alone take {weight_bytes / _GIB:.2f} GiB, more "
            f"than {util} x {memory_bytes / _GIB:.2f} GiB = {usable / _GIB:.2f} GiB of device "
            f"memory; raise --gpu-memory-utilization, quantize the weights (--quantization fp8), "
            f"or split them over devices (--tensor-parallel-size)"
        )
    plan = MemoryPlan(
        device=memory_bytes,
        usable=usable,
        weights=weight_bytes,
        forward=int(step_bytes.get("forward", 0)),
        lm_head=int(step_bytes.get("prompt_logits", 0)),
        sampler=sched.max_num_seqs * vocab_size * 4 * _LOGITS_COPIES,
        margin=int(_MARGIN_FRACTION * memory_bytes),
    )
    if plan.kv_cache <= 0:
        raise ConfigError(
            f"gpu_memory_utilization: no device memory left for the KV cache ({plan.describe()}); "
            f"raise --gpu-memory-utilization, or lower --max-num-batched-tokens "
            f"({sched.max_num_batched_tokens}) or --max-num-seqs ({sched.max_num_seqs})"
        )
    return plan


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: Any) -> Any:
    """The KV cache's jnp dtype (a numpy dtype; jnp.dtype is typed as returning Any) for ``--kv-cache-dtype``: "auto" -> the model dtype; "fp8" and
    "fp8_e4m3" (vLLM's names) -> float8_e4m3fn."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return jnp.dtype(jnp.float8_e4m3fn)
    raise ConfigError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES} (got {kv_cache_dtype!r})")


def _tree_nbytes(tree: Any) -> int:
    """Bytes of every array in ``tree`` (quantized records count their data and scales), as the
    devices hold them: an array placed over a mesh counts each device's shard, so a replicated
    array counts once a device (a MoE model's experts under plain TP) and a split one once in
    all (split on E with --enable-expert-parallel). The memory plan compares this total with the
    mesh's memory (device memory x TP)."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        sharding = getattr(x, "sharding", None)
        if sharding is None or len(sharding.device_set) == 1:
            total += x.nbytes
        else:
            shard = math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
            total += shard * len(sharding.device_set)
    return total


def check_moe_combinations(
    config: EngineConfig, arch: ModelArch, checkpoint_method: str | None = None
) -> None:
    """Refuse, by name, what a mixture-of-experts model does not support yet: its experts are
    multiplied by models/moe.py's grouped matmul, which takes them dense or as the checkpoint's
    own MXFP4 records (gpt-oss) but not quantized online, and which the draft heads' target
    interface does not know about. Tensor parallelism is supported (experts replicated, or split
    on E with ``enable_expert_parallel``, which this also validates, for dense models too).
    ``checkpoint_method``: the loaded checkpoint's format; ``--quantization`` naming it is what
    the checkpoint is, not a request.
    Raises ConfigError naming the setting; returns for a dense model or a supported MoE setting."""
    par = config.parallel
    if par.enable_expert_parallel:
        try:
            check_expert_parallel(arch, par.tensor_parallel_size)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    if arch.moe is None:
        return
    spec, quant = config.speculative, config.quantization.method
    draft = None if spec is None else str(spec.method)
    unsupported = [
        (par.data_parallel_size > 1, f"data_parallel_size={par.data_parallel_size}"),
        (quant is not None and quant != checkpoint_method, f"quantization={quant!r}"),
        (draft in (SpecMethod.EAGLE3, SpecMethod.MTP), f"speculative_config.method={draft!r}"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(
                f"{what} with a mixture-of-experts model ({arch.architecture}) is not supported yet"
            )


class Worker:
    def __init__(self, config: EngineConfig, replica: int = 0, timings: StartupTimings | None = None) -> None:
        """replica: which data-parallel replica this worker is (its device subset, mesh.py).
        timings: the start-up record its steps add their phases to (startup_timing.py); None: a
        new one (``self.timings``)."""
        self.timings = StartupTimings() if timings is None else timings
        t0 = time.perf_counter()
        self.device = discover()
        # "auto" modes made concrete here, once, for every front end (engine, vLLM, SGLang).
        config = self.config = config.with_modes_resolved(self.device.backend)
        par = config.parallel
        self.tensor_parallel_size = par.tensor_parallel_size
        # No mesh on a single device: the one-device engine stays exactly what it was.
        self.mesh = None
        if par.tensor_parallel_size * par.data_parallel_size > 1:
            # Several processes (multihost.py): each replica's TP group takes devices of every host.
            hosts = jax.process_count()
            devices = (
                None if hosts == 1 else mesh_devices(par.tensor_parallel_size, hosts, par.data_parallel_size)
            )
            plan = plan_devices(par.tensor_parallel_size, par.data_parallel_size, devices)
            self.mesh = replica_mesh(plan, replica)
        self.compilation_cache_dir = enable_compilation_cache(config.compilation.compilation_cache_dir)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        # (k_scale, v_scale) of an FP8 KV cache: the checkpoint's (load), else calibrated when the
        # runner is built (init_kv_cache). None for a cache in the model dtype.
        self.kv_scales: tuple[float, float] | None = None
        # Set by load(); None until then (read them after loading through loaded_arch()).
        self.arch: ModelArch | None = None
        self.tokenizer: Any = None  # a transformers tokenizer (the loader's LoadedModel.tokenizer)
        self.model_source: str | None = None
        self.max_model_len: int | None = None
        self.runner: ModelRunner | None = None
        self._params: dict[str, Any] | None = None
        self.quantization: str | None = None  # the weights' format once loaded (None: dense)
        self.quant_report: QuantReport | None = None  # models.quantize.QuantReport after online quantization
        # A model-based drafter (EAGLE-3 / MTP): its DraftHead and params once loaded, then its
        # DraftRunner beside the ModelRunner (draft_runner.py).
        self.draft_head: DraftHead | None = None
        self._draft_params: dict[str, Any] | None = None
        self.draft_runner: DraftRunner | None = None
        self._plan: MemoryPlan | None = None  # the accelerator memory plan, once measured
        self.timings.add("worker setup", time.perf_counter() - t0)

    # What load() and init_kv_cache() set, for the steps that need them to have run: a typed
    # value or an error that names the missing step (not an AttributeError on None).

    def loaded_arch(self) -> ModelArch:
        if self.arch is None:
            raise RuntimeError("Worker.load() must run first")
        return self.arch

    def loaded_model_len(self) -> int:
        if self.max_model_len is None:
            raise RuntimeError("Worker.load() must run first")
        return self.max_model_len

    def _built_runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("Worker.init_kv_cache() must run first")
        return self.runner

    # ---- weights ----

    def load(self, *, clamp_max_model_len: bool = False) -> None:
        """Load weights and tokenizer. A max_model_len beyond the model's limit is an error, or is
        lowered to it with ``clamp_max_model_len`` (a front end that derived it from elsewhere)."""
        t0 = time.perf_counter()
        m = self.config.model
        # A mesh over several processes: each reads only its own devices' shards of the weights
        # (loader.load_model's shard_reads; the runner's placement reads them).
        here = jax.process_index()
        shard_reads = self.mesh is not None and any(d.process_index != here for d in self.mesh.devices.flat)
        loaded = load_model(m.model, self.dtype, m.tokenizer, self.timings, shard_reads=shard_reads)
        arch = self.arch = loaded.arch
        check_moe_combinations(self.config, arch, loaded.quantization)
        self.tokenizer, self.model_source = loaded.tokenizer, loaded.source
        params = loaded.params
        if self.tensor_parallel_size > 1:
            with self.timings.phase("shard heads"):
                params = self._shard_heads(params, loaded.quantization)
        with self.timings.phase("quantize"):
            self._params = self._quantize(params, loaded.quantization)
        if self.kv_cache_dtype.itemsize == 1 and loaded.kv_scales_error is not None:
            raise ModelConfigError(
                f"kv_cache_dtype={self.config.cache.kv_cache_dtype!r}: {loaded.kv_scales_error}"
            )
        if self.kv_cache_dtype.itemsize == 1 and loaded.kv_scales is not None:
            self.kv_scales = loaded.kv_scales
            log.info(
                "FP8 KV cache: the checkpoint's scales (max over layers): k_scale %.6g, v_scale %.6g",
                *self.kv_scales,
            )
        limit = arch.max_position_embeddings
        want = m.max_model_len or limit
        if want > limit and clamp_max_model_len:
            want = limit
        if want > limit:
            raise ConfigError(f"max_model_len: {want} exceeds the model's max_position_embeddings={limit}")
        self.max_model_len = want
        self._fit_page_size()
        log.info(
            "loaded %s (%s, %d layers) in %.1f s",
            loaded.source,
            arch.architecture,
            arch.num_layers,
            time.perf_counter() - t0,
        )
        spec = self.config.speculative
        if spec is not None and spec.method in (SpecMethod.EAGLE3, SpecMethod.MTP):
            with self.timings.phase("draft head"):
                self._load_draft(spec, loaded.source)

    def _executable_cache_dir(self) -> str | None:
        """Where the runner keeps its compiled forwards across restarts: beside JAX's persistent
        cache. None over several processes, whose programs must be built together, and where
        ``executable_cache`` says off (by default on CPU: config.py says why)."""
        wanted = self.config.compilation.executable_cache
        if wanted is None:
            wanted = self.device.backend != "cpu"
        if not wanted or jax.process_count() > 1:
            return None
        return os.path.join(self.compilation_cache_dir, "tpuserve-executables")

    def _fit_page_size(self) -> None:
        """Raise the page size (block_size) to what the attention kernel's page table needs at
        this max_model_len (attention/kv_cache_shape.min_page_size: the Pallas TPU kernel holds
        the table in SMEM); a block_size the user set that is too small is an error."""
        cache = self.config.cache
        impl = self.config.compilation.attention_impl
        max_num_seqs = self.config.scheduler.max_num_seqs
        need = min_page_size(impl, self.loaded_model_len(), max_num_seqs)
        if cache.block_size >= need:
            return
        if "block_size" in self.config.explicit:
            raise ConfigError(
                f"block_size={cache.block_size}: the {impl} attention kernel's page table "
                f"(max_num_seqs={max_num_seqs} x max_model_len={self.loaded_model_len()} / block_size) "
                f"would not fit its SMEM; use block_size >= {need} (vLLM's --block-size, SGLang's "
                f"--page-size), or a smaller max_model_len or max_num_seqs"
            )
        log.info(
            "block_size %d -> %d: max_model_len=%d x max_num_seqs=%d needs bigger pages for the %s "
            "kernel's page table (SMEM)",
            cache.block_size,
            need,
            self.loaded_model_len(),
            max_num_seqs,
            impl,
        )
        self.config = replace(self.config, cache=replace(cache, block_size=need))

    def _load_draft(self, spec: SpeculativeConfig, target_source: str) -> None:
        if self.mesh is not None:
            raise ConfigError(
                f"speculative_config.method={spec.method!r} runs its draft head on one "
                f"device; it is not supported with tensor or data parallelism yet"
            )
        if self.quantization is not None:
            raise ConfigError(
                f"speculative_config.method={spec.method!r}: the draft head shares the "
                f"target's embedding, which a quantized target ({self.quantization}) "
                f"does not keep dense; not supported yet"
            )
        if self._params is None:
            raise RuntimeError("Worker._load_draft: the target's weights are not loaded")
        head, self._draft_params = load_draft(
            spec.method, spec.model, target_source, self.loaded_arch(), self._params, self.dtype
        )
        self.draft_head = head
        log.info(
            "draft head: %s (%d-token vocabulary, features %s)",
            spec.method,
            head.draft_vocab_size,
            head.aux_layer_ids or "final hidden state",
        )

    def _shard_heads(self, params: dict[str, Any], checkpoint_method: str | None) -> dict[str, Any]:
        """Check the model splits over the TP devices; replicate KV heads when there are fewer
        than devices (models/sharding.py), before any online quantization."""
        tp = self.tensor_parallel_size
        arch = self.loaded_arch()
        try:
            r = check_tensor_parallel(arch, tp)
            # Only a quantized qkv cannot be replicated: gpt-oss's MXFP4 checkpoints quantize
            # the experts alone, and their dense qkv replicates like any other.
            if r > 1 and checkpoint_method is not None and _qkv_is_quantized(params):
                raise ValueError(
                    f"tensor_parallel_size={tp}: the model's {arch.num_kv_heads} "
                    f"KV heads would need replicating, which a pre-quantized "
                    f"({checkpoint_method}) checkpoint's qkv cannot be; use a TP size "
                    f"that divides the KV heads"
                )
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if r > 1:
            log.info(
                "tensor parallel %d over %d KV heads: each KV head replicated %d times",
                tp,
                arch.num_kv_heads,
                r,
            )
            params, self.arch = replicate_kv_heads(params, arch, tp)  # a sharded load's too
        if checkpoint_method is None and self.config.quantization.method is not None:
            if self._quantizes_on_devices(params):
                params = self._placed(params)  # each host reads its shards; grouped and quantized there
            params = group_gate_up_by_device(read_whole(params), tp)  # so its quantized record splits by F
        elif checkpoint_method is not None and tp > 1:
            try:  # a pre-quantized gate_up: its columns reordered so that it splits by F too
                params = group_gate_up_records_by_device(params, tp)
            except ValueError as e:
                raise ConfigError(f"tensor_parallel_size={tp}: {e}") from e
        return params

    def _calibration(self, method: str) -> tuple[ModelArch, Any] | None:
        """GPTQ's ``(arch, token_ids)`` when ``method`` is quantized by calibration, else None."""
        if method in calibrate.GPTQ_METHODS and self.config.quantization.calibration == QuantCalibration.GPTQ:
            return (self.loaded_arch(), calibrate.calibration_token_ids(self.tokenizer))
        return None

    def _quantizes_on_devices(self, params: dict[str, Any]) -> bool:
        """Whether an online quantization runs over weights placed by shard: a sharded load
        (weights still ``HostSource``s). Round-to-nearest is per weight and runs on the devices
        (XLA combines a row-split weight's column maxima); GPTQ runs its layer passes sharded and
        quantizes each device's columns on the host that holds it (``models/calibrate.py``)."""
        method = self.config.quantization.method
        sources = any(isinstance(x, HostSource) for x in jax.tree_util.tree_leaves(params))
        return method is not None and sources and self.mesh is not None

    def _placed(self, params: dict[str, Any]) -> dict[str, Any]:
        """The dense weights on the mesh as the runner shards them (models/sharding.py); a source
        is read here, by shard."""
        assert self.mesh is not None
        mesh = self.mesh
        ep = bool(self.config.parallel.enable_expert_parallel) and model_axis_size(mesh) > 1
        specs = param_partition_specs(params, MODEL_AXIS, expert_parallel=ep)
        placed: dict[str, Any] = jax.tree_util.tree_map(
            lambda a, s: place(a, NamedSharding(mesh, s)), params, specs
        )
        return placed

    def _quantize(self, params: dict[str, Any], checkpoint_method: str | None) -> dict[str, Any]:
        """The quantization step of loading: route ``linear`` for quantized records, and quantize an
        unquantized checkpoint's linear weights when ``--quantization`` asks (models/quantize.py).

        checkpoint_method: the format a pre-quantized checkpoint already carries (the loader read
        its ``quantization_config``); the flag must then be unset or name that same format.
        """
        method = self.config.quantization.method
        if checkpoint_method is not None:
            if method is not None and method != checkpoint_method:
                raise ConfigError(
                    f"quantization: the checkpoint is already quantized as "
                    f"{checkpoint_method!r}; leave --quantization unset or pass "
                    f"{checkpoint_method!r} (got {method!r})"
                )
            self.quantization = checkpoint_method
            log.info(
                "checkpoint is pre-quantized (%s): weights %.1f MiB",
                checkpoint_method,
                _tree_nbytes(params) / 2**20,
            )
            return params
        if method is None:
            return params
        self.quantization = method
        t0 = time.perf_counter()
        calibration = self._calibration(method)
        # A sharded load's weights were placed by shard already (_shard_heads): both recipes
        # quantize them where they are
        params, report = quantize_params(read_whole(params), method, calibration=calibration)
        self.quant_report = report
        log.info(
            "quantized online in %.1f s (%s): %s",
            time.perf_counter() - t0,
            "GPTQ" if calibration else "round-to-nearest",
            report.summary(),
        )
        return params

    @property
    def weight_bytes(self) -> int:
        return _tree_nbytes(self._params if self._params is not None else self._built_runner().params)

    # ---- KV cache sizing: the one formula ----

    def page_bytes(self) -> int:
        """Bytes one KV page takes across all layers, in the layout the attention backend uses."""
        return self.page_bytes_padded_and_plain()[0]

    def page_bytes_padded_and_plain(self) -> tuple[int, int]:
        """(bytes of a page as the attention backend lays it out, bytes of its real K/V)."""
        a = self.loaded_arch()
        impl = self.config.compilation.attention_impl
        spec = KVCacheSpec(
            a.num_layers,
            1,
            self.config.cache.block_size,
            a.num_kv_heads,
            a.head_dim,
            self.kv_cache_dtype,
            num_shards=self.tensor_parallel_size,
        )
        padded, plain = spec.page_bytes(impl), spec.bytes_per_page
        if self.draft_head is not None:  # the draft head's one layer shares the page geometry
            d = self.draft_head.arch
            draft = KVCacheSpec(1, 1, self.config.cache.block_size, d.num_kv_heads, d.head_dim, self.dtype)
            padded, plain = padded + draft.page_bytes(impl), plain + draft.bytes_per_page
        return padded, plain

    def kv_cache_budget(self) -> int:
        """Bytes for the whole (all devices') KV cache: ``kv_cache_memory_bytes`` when given; on an
        accelerator what ``memory_plan`` leaves; on a CPU host a fixed 1 GiB. Weights and pages
        are counted whole, so an accelerator's memory is the mesh's (TP devices x one device's)."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return int(cache.kv_cache_memory_bytes)
        if not (self.device.is_accelerator and self.device.memory_bytes):
            return CPU_KV_CACHE_BYTES
        return self.memory_plan().kv_cache

    def memory_plan(self) -> MemoryPlan:
        """The accelerator's memory plan (computed once): builds the ModelRunner without its
        cache and measures the step programs it will run (vLLM's profile run, from the compiler's
        memory analysis instead of a run)."""
        if self._plan is None:
            runner = self._build_runner(None)
            t0 = time.perf_counter()
            with self.timings.phase("memory plan"):
                step = runner.step_memory()
            if not self.device.memory_bytes:  # kv_cache_budget plans only on a device that reports it
                raise RuntimeError("Worker.memory_plan: the device reports no memory size")
            memory = self.device.memory_bytes * self.tensor_parallel_size
            self._plan = plan_memory(
                self.config,
                memory_bytes=memory,
                weight_bytes=self.weight_bytes,
                step_bytes=step,
                vocab_size=self.loaded_arch().vocab_size,
            )
            log.info(
                "memory plan (step programs measured in %.1f s): %s",
                time.perf_counter() - t0,
                self._plan.describe(),
            )
        return self._plan

    def num_pages(self, *, need_full_sequence: bool = True) -> int:
        """KV pages (page 0 reserved included): ``num_gpu_blocks`` if set, else what the budget
        holds, never more than every sequence slot at full length could use. Refuses a cache
        that cannot hold one sequence of max_model_len (unless the front end's own scheduler
        admits by its pool size, as SGLang's does)."""
        cache = self.config.cache
        pages_per_seq = -(-self.loaded_model_len() // cache.block_size)
        if cache.num_gpu_blocks is not None:
            n = cache.num_gpu_blocks
        else:
            n = min(
                self.kv_cache_budget() // self.page_bytes(),
                self.config.scheduler.max_num_seqs * pages_per_seq + 1,
            )
        if n < 2 or (need_full_sequence and n - 1 < pages_per_seq):
            raise ConfigError(
                f"num_gpu_blocks: the KV cache has {n - 1} usable pages ({(n - 1) * cache.block_size} "
                f"tokens), fewer than one sequence of max_model_len={self.max_model_len} needs; "
                f"lower max_model_len or give the cache more memory"
            )
        return int(n)

    # ---- runner ----

    def _build_runner(self, num_pages: int | None) -> ModelRunner:
        """The ModelRunner (built once; it owns the weights from here), with ``num_pages`` KV
        pages, or without a cache yet (None)."""
        if self.runner is not None:
            if num_pages is not None:
                with self.timings.phase("kv cache"):
                    self.runner.allocate_kv_cache(num_pages)
                    for leaf in jax.tree.leaves(self.runner.kv_cache):
                        leaf.block_until_ready()
            return self.runner
        if self._params is None:
            raise RuntimeError("Worker.load() must run before init_kv_cache()")
        arch = self.loaded_arch()
        calibration = None
        if self.kv_cache_dtype.itemsize == 1 and self.kv_scales is None:
            calibration = kv_scales.calibration_token_ids(self.tokenizer, arch.vocab_size)
        t0 = time.perf_counter()
        runner = self.runner = ModelRunner(
            self.config,
            arch,
            self._params,
            self.device,
            self.dtype,
            num_pages,
            self.loaded_model_len(),
            mesh=self.mesh,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_scales=self.kv_scales,
            calibration_tokens=calibration,
            draft_aux_layers=(None if self.draft_head is None else self.draft_head.aux_layer_ids),
            executable_cache_dir=self._executable_cache_dir(),
        )
        # Weight placement over a mesh, per-layer arrays for an unrolled loop, FP8 KV calibration,
        # and the KV cache when num_pages is given: one phase (the runner does them in one go).
        for leaf in jax.tree.leaves((runner.params, runner.kv_cache)):
            leaf.block_until_ready()
        self.timings.add("runner setup", time.perf_counter() - t0)
        self._params = None
        return runner

    def init_kv_cache(self, num_pages: int) -> ModelRunner:
        """Build the ModelRunner over ``num_pages`` KV pages; the runner owns the weights from here."""
        runner = self._build_runner(num_pages)
        self.kv_scales = runner.kv_scales
        # The draft params are handed to the DraftRunner once: a second call keeps that runner.
        if self.draft_head is not None and self._draft_params is not None:
            self.draft_runner = DraftRunner(self.draft_head, self._draft_params, runner)
            self._draft_params = None
        log.info(
            "KV cache: %d pages of %d tokens (%.2f GiB, %s), token buckets %s, page buckets %s",
            num_pages,
            self.config.cache.block_size,
            self._kv_spec(runner).page_bytes(runner.attn_impl) * num_pages / (1 << 30),
            self.kv_cache_dtype.name,
            runner.token_buckets,
            runner.page_buckets,
        )
        return runner

    @staticmethod
    def _kv_spec(runner: ModelRunner) -> KVCacheSpec:
        if runner.kv_spec is None:  # _build_runner(num_pages) allocated it
            raise RuntimeError("Worker: the runner has no KV cache yet")
        return runner.kv_spec

    def warmup(self, *, progress: bool = True) -> int:
        """Compile every program a step can run (the runner's on a thread pool); returns how many."""
        t0 = time.perf_counter()
        n = self._warm_draft_runner()
        n += self._built_runner().warmup(progress=progress)
        self.timings.add("warm-up", time.perf_counter() - t0)
        log.info("warm-up compiled %d programs in %.1f s", n, time.perf_counter() - t0)
        return n

    def start_warmup(self, *, progress: bool = True) -> Warmup:
        """Start compiling in the background (``ModelRunner.start_warmup``) and return once the
        programs of a first short request are ready; the draft runner's programs compile first, in
        the foreground (its warm-up runs steps on its own cache)."""
        with self.timings.phase("warm-up (first programs)"):
            self._warm_draft_runner()
            warm = self._built_runner().start_warmup(progress=progress)
            warm.wait_first()
        return warm

    def _warm_draft_runner(self) -> int:
        if self.draft_runner is None:
            return 0
        spec = self.config.speculative
        if spec is None:  # a draft runner is only built for a speculative config
            raise RuntimeError("Worker: a draft runner without a speculative config")
        return self.draft_runner.warmup(self.dtype, spec.num_speculative_tokens)

    def shutdown(self) -> None:
        self.runner = None
        self.draft_runner = None
        self._params = None


def _qkv_is_quantized(params: dict[str, Any]) -> bool:
    """Whether the layers' fused qkv is a quantized record (an array or a sharded load's source
    has a rank; a record does not)."""
    layers = params["layers"]
    first = layers[0] if isinstance(layers, (list, tuple)) else layers
    return not hasattr(first["qkv"], "ndim")

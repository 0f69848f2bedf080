"""``TpuserveWorker``: vLLM's worker interface implemented over our JAX ``ModelRunner``.

vLLM calls, in order: ``init_device`` (JAX backend, compilation cache, dtype), ``load_model`` (our
loader: weights to device), ``get_kv_cache_spec`` (one full-attention spec per layer: our page size,
KV heads, head_dim, dtype), ``determine_available_memory`` (bytes vLLM may turn into KV blocks),
``initialize_from_config`` (vLLM's num_blocks become our KV pages, one for one, page 0 being vLLM's
null block), ``compile_or_warm_up_model`` (every shape bucket, on accelerators), then each step
``execute_model`` (SchedulerOutput deltas -> planned chunks) and ``sample_tokens`` (grammar bitmask
in, ModelRunnerOutput out). The model step itself runs in ``sample_tokens``: our runner samples on
device in the same program as the forward pass, and the bitmask only exists by then. With the
synchronous uniproc executor this loses no overlap.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, LogprobsTensors, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from tpuserve.tpu_platform.vllm_plugin.options import PluginOptions
from tpuserve.tpu_platform.vllm_plugin.request_state import RequestTable, StepPlan, StepResult

log = logging.getLogger("vllm.tpuserve.worker")

_TORCH_TO_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_CPU_DEFAULT_KV_BYTES = 1 << 30  # like our engine: host RAM is shared with everything else
# Activation headroom kept free on an accelerator, per scheduled token (a generous bound for the
# hidden/MLP intermediates of one step) plus the [S, V] f32 logits and sampler temporaries.
_ACT_BYTES_PER_TOKEN_FACTOR = 16


class TpuserveWorker(WorkerBase):
    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int,
                 distributed_init_method: str, is_driver_worker: bool = False):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.options = PluginOptions.from_vllm(vllm_config)
        self.device_info = None
        self.dtype = None
        self.arch = None
        self.params = None
        self.runner = None
        self.table: RequestTable | None = None
        self._pending: StepPlan | None = None
        self._compiled_after_warmup: int | None = None

    # ---- start-up ----

    def init_device(self) -> None:
        from tpuserve.tpu_platform.device import discover, enable_compilation_cache, resolve_dtype

        self.device_info = discover()
        cache_dir = enable_compilation_cache(self.options.compilation_cache_dir)
        name = _TORCH_TO_NAME.get(self.model_config.dtype)
        if name is None:
            raise ValueError(f"dtype {self.model_config.dtype}: the tpuserve platform runs "
                             f"float32, bfloat16 or float16")
        self.dtype = resolve_dtype(name, self.device_info)
        # vLLM's own tensors around this worker stay on the host (see platform.py).
        self.device = torch.device("cpu")
        log.info("tpuserve worker on JAX %s (%d x %s), dtype %s, XLA cache %s",
                 self.device_info.backend, self.device_info.device_count,
                 self.device_info.device_kind, name, cache_dir)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        from tpuserve.tpu_platform.loader import load_model

        if load_dummy_weights:
            raise NotImplementedError("dummy weights are not supported on the tpuserve platform")
        fmt = str(self.load_config.load_format)
        if fmt not in ("auto", "safetensors", "gguf", "LoadFormats.AUTO"):
            raise ValueError(f"load_format={fmt!r}: the tpuserve platform loads safetensors or GGUF")
        t0 = time.perf_counter()
        loaded = load_model(self.model_config.model, self.dtype)
        self.arch, self.params = loaded.arch, loaded.params
        vocab = self.model_config.get_vocab_size()
        if vocab != self.arch.vocab_size:
            raise ValueError(f"vocab size mismatch: vLLM's config says {vocab}, the checkpoint "
                             f"has {self.arch.vocab_size}")
        log.info("loaded %s (%s, %d layers) in %.1f s", loaded.source, self.arch.architecture,
                 self.arch.num_layers, time.perf_counter() - t0)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One full-attention spec per layer, so vLLM's page bytes equal ours exactly.

        vLLM's page (per layer) = 2 * block_size * num_kv_heads * head_size * itemsize: our
        interleaved page [page_size, 2*Hkv, D] holds the same bytes. A sliding-window model is
        described as full attention with the window recorded, so vLLM keeps every page and our
        attention applies the window.
        """
        a = self.arch
        spec = FullAttentionSpec(block_size=self.cache_config.block_size, num_kv_heads=a.num_kv_heads,
                                 head_size=a.head_dim, dtype=self.model_config.dtype,
                                 sliding_window=a.sliding_window)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(a.num_layers)}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        # Our cache is [L, pages, page_size, 2*Hkv (K,V interleaved), D]: blocks, then tokens, then
        # heads. The base class would ask vLLM's torch attention backends, which we do not build.
        return ["LBNHC"]

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: an explicit size if given, else what the accelerator has left."""
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            return int(explicit)
        info = self.device_info
        if not info.is_accelerator or not info.memory_bytes:
            return _CPU_DEFAULT_KV_BYTES
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        in_use = int(stats.get("bytes_in_use", 0))  # the weights, just loaded
        sched = self.scheduler_config
        a = self.arch
        act = (sched.max_num_batched_tokens * max(a.hidden_size, a.intermediate_size) * 4
               * _ACT_BYTES_PER_TOKEN_FACTOR + sched.max_num_seqs * a.vocab_size * 4 * 4)
        budget = int(self.cache_config.gpu_memory_utilization * info.memory_bytes) - in_use - act
        if budget <= 0:
            raise ValueError(f"no device memory left for the KV cache ({in_use} bytes in use of "
                             f"{info.memory_bytes}); raise --gpu-memory-utilization or shrink the model")
        return budget

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate our KV pages: vLLM's block ids index them directly."""
        from tpuserve.tpu_platform.config import EngineConfig
        from tpuserve.tpu_platform.model_runner import ModelRunner

        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"expected one KV cache group, vLLM built {len(groups)}")
        block_size = groups[0].kv_cache_spec.block_size
        num_blocks = int(kv_cache_config.num_blocks)
        sched = self.scheduler_config
        max_len = int(self.model_config.max_model_len)
        config = EngineConfig(
            model=self.model_config.model, dtype=_TORCH_TO_NAME[self.model_config.dtype],
            max_model_len=max_len, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens, block_size=block_size,
            num_gpu_blocks=num_blocks, seed=int(self.model_config.seed or 0),
            attention_impl=self.options.attention_impl,
            enable_chunked_prefill=bool(sched.enable_chunked_prefill),
            compilation_cache_dir=self.options.compilation_cache_dir,
            max_logprobs=min(max(int(self.model_config.max_logprobs), 0), 1024))
        self.runner = ModelRunner(config, self.arch, self.params, self.device_info, self.dtype,
                                  num_blocks, max_len)
        self.params = None  # the runner holds them now
        self.table = RequestTable(block_size, self.arch.vocab_size, seed=config.seed)
        log.info("KV cache: %d pages of %d tokens (%.2f GiB), token buckets %s, page buckets %s",
                 num_blocks, block_size, self.runner.kv_spec.bytes_per_page * num_blocks / (1 << 30),
                 self.runner.token_buckets, self.runner.page_buckets)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        warmup = self.options.warmup
        if warmup is None:
            warmup = self.device_info.is_accelerator
        if not warmup:
            log.info("warm-up skipped (%s): programs compile on first use and persist in the XLA cache",
                     "JAX CPU backend" if self.options.warmup is None else "warmup=false / --enforce-eager")
            return CompilationTimes(language_model=0.0, encoder=0.0)
        t0 = time.perf_counter()
        n = self.runner.warmup()
        self._compiled_after_warmup = self.runner.compile_count
        secs = time.perf_counter() - t0
        log.info("warm-up compiled %d programs in %.1f s", n, secs)
        return CompilationTimes(language_model=secs, encoder=0.0)

    def update_max_model_len(self, max_model_len: int) -> None:
        # Called only when vLLM shrinks the length to fit memory, before initialize_from_config.
        self.model_config.max_model_len = max_model_len

    # ---- steps ----

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        if getattr(scheduler_output, "kv_connector_metadata", None) is not None:
            raise NotImplementedError("KV connectors are not supported on the tpuserve platform")
        plan = self.table.plan(scheduler_output)
        if not plan.seqs:
            return EMPTY_MODEL_RUNNER_OUTPUT  # a step that only retired requests
        self._pending = plan
        return None  # vLLM now calls sample_tokens with the grammar bitmask

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        plan, self._pending = self._pending, None
        if plan is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        seqs = plan.scheduled(self.table, self._grammar_masks(grammar_output))
        step = self.runner.execute(self.runner.build_batch(seqs))
        result = plan.finish(self.table, step)
        self._check_recompiles()
        return _to_vllm_output(result)

    def _grammar_masks(self, grammar_output: Any) -> dict[str, np.ndarray]:
        """Structured-output bitmask rows by request id (xgrammar's layout, as our sampler takes)."""
        if grammar_output is None:
            return {}
        words = (self.arch.vocab_size + 31) // 32
        bitmask = np.asarray(grammar_output.grammar_bitmask, dtype=np.int32)
        if bitmask.ndim != 2:
            raise ValueError(f"grammar bitmask must be 2-D, got shape {bitmask.shape}")
        if bitmask.shape[1] < words:  # tokens past the grammar's vocabulary stay disallowed
            bitmask = np.pad(bitmask, ((0, 0), (0, words - bitmask.shape[1])))
        return {rid: bitmask[i, :words]
                for i, rid in enumerate(grammar_output.structured_output_request_ids)}

    def _check_recompiles(self) -> None:
        if self._compiled_after_warmup is None:
            return
        now = self.runner.compile_count
        if now > self._compiled_after_warmup:
            log.warning("compiled %d program(s) after warm-up (a shape bucket or sampler variant "
                        "it did not cover)", now - self._compiled_after_warmup)
            self._compiled_after_warmup = now

    # ---- the rest of vLLM's worker interface ----

    def take_draft_token_ids(self) -> None:
        return None  # no speculative decoding through the plugin

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_cache_block_size_bytes(self) -> int:
        return self.runner.kv_spec.bytes_per_page

    def get_model(self):
        raise NotImplementedError("the tpuserve platform's model is a JAX program, not a torch module")

    def synchronize_device(self) -> None:
        if self.runner is not None:
            import jax
            jax.block_until_ready(self.runner.kv_cache)

    def reset_encoder_cache(self) -> None:
        return None  # text-only: no encoder cache

    def check_health(self) -> None:
        if self.device_info is None:
            raise RuntimeError("tpuserve worker: device not initialised")

    def add_lora(self, lora_request) -> bool:
        raise NotImplementedError("LoRA is not supported on the tpuserve platform")

    def remove_lora(self, lora_id: int) -> bool:
        raise NotImplementedError("LoRA is not supported on the tpuserve platform")

    def pin_lora(self, lora_id: int) -> bool:
        raise NotImplementedError("LoRA is not supported on the tpuserve platform")

    def list_loras(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        self._pending = None
        self.table = None
        self.runner = None  # drops the KV cache and weights
        self.params = None


def _to_vllm_output(r: StepResult) -> ModelRunnerOutput:
    logprobs = None
    if r.logprob_token_ids is not None:
        logprobs = LogprobsLists(logprob_token_ids=r.logprob_token_ids, logprobs=r.logprobs,
                                 sampled_token_ranks=r.sampled_ranks)
    prompt = {rid: LogprobsTensors(logprob_token_ids=torch.from_numpy(b.token_ids),
                                   logprobs=torch.from_numpy(b.logprobs),
                                   selected_token_ranks=torch.from_numpy(b.ranks))
              for rid, b in r.prompt_logprobs.items()}
    return ModelRunnerOutput(req_ids=r.req_ids, req_id_to_index={rid: i for i, rid in enumerate(r.req_ids)},
                             sampled_token_ids=r.sampled_token_ids, logprobs=logprobs,
                             prompt_logprobs_dict=prompt)


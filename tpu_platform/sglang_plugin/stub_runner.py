"""SGLang's ModelRunner with the model and the KV pool taken out: host bookkeeping only.

SGLang's scheduler reaches into ``tp_worker.model_runner`` for its request->slot table
(``req_to_token_pool``), its slot allocator and pool sizes. Those stay SGLang's own objects, so its
radix cache, chunked prefill and continuous batching run unchanged. What this runner does not do:
load torch weights, allocate a torch KV pool, build attention backends or capture graphs. The
weights and the KV cache live in our JAX executor; ``NoTorchKVCache`` stands where SGLang expects
a pool object and holds no buffer at all (``get_kv_size_bytes() == (0, 0)``).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import KVCache, ReqToTokenPool
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
from sglang.srt.runtime_context import get_exec, get_schedule

log = logging.getLogger(__name__)


class NoTorchKVCache(KVCache):
    """The pool object SGLang's allocator wants, without any torch buffer behind it.

    ``KVCache.__init__`` is skipped on purpose: it sets up memory-saver and custom pools that
    assume a CUDA device. Any attempt to read or write K/V through torch fails loudly.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, layer_num: int):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        # As SGLang's own pools store FP8 (index_put has no float8 kernel): bytes. Nothing is stored.
        self.store_dtype = torch.uint8 if dtype.itemsize == 1 else dtype
        self.device = "cpu"
        self.layer_num = layer_num
        self.start_layer = 0
        self.end_layer = layer_num - 1
        self.allocation_label = "tpuserve (JAX)"
        self.mem_usage = 0
        self.cpu_offloading_chunk_size = 8192
        self.layer_transfer_counter = None
        self.enable_custom_mem_pool = False
        self.custom_mem_pool = None

    def _no_buffer(self, *args, **kwargs):
        raise RuntimeError(
            "the KV cache lives in tpuserve's JAX executor; there is no torch KV buffer to read or write"
        )

    get_key_buffer = _no_buffer
    get_value_buffer = _no_buffer
    get_kv_buffer = _no_buffer
    set_kv_buffer = _no_buffer

    def get_kv_size_bytes(self):
        return 0, 0


class _NoTorchModel:
    """Stands in for the torch model where SGLang inspects it (signature, a few attributes)."""

    def __init__(self):
        from sglang.srt.configs.shared_experts import SharedExpertsConfig

        self.shared_experts_config = SharedExpertsConfig()  # read by SGLang's warm-up paths

    def forward(self):
        raise RuntimeError("the model runs in tpuserve's JAX executor, not through torch")


class TpuServeModelRunnerStub(ModelRunner):
    """Keeps SGLang's request table and slot allocator; sized by our executor's KV cache."""

    canary_manager = None  # the KV canary reads torch KV buffers; there are none
    prefill_aware_swa = False

    def __init__(self, *args, executor, **kwargs):
        self._executor = executor
        super().__init__(*args, **kwargs)

    @property
    def logical_max_total_num_tokens(self) -> int:
        # Every slot holds one token of one request: no context-parallel expansion to account for.
        return self.max_total_num_tokens

    @property
    def preloaded_weights_bytes(self) -> int:
        return 0  # no torch weights

    def load_model(self):
        log.info("tpuserve: SGLang loads no torch weights; the model runs in JAX")
        self.model = _NoTorchModel()
        self.sliding_window_size = None
        self.dtype = self.model_config.dtype
        self.weight_load_mem_usage = 0

    def initialize(self):
        from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

        self.memory_saver_adapter = TorchMemorySaverAdapter.create(
            enable=get_exec().features.enable_memory_saver
        )
        self.sampler = None
        self.load_model()
        layers = self.model_config.num_hidden_layers
        self.layer_info = ModelLayerInfo(start_layer=0, end_layer=layers, num_effective_layers=layers)
        ex = self._executor
        # What our JAX cache really holds (SGLang's bookkeeping only records it; no torch buffer):
        # the model dtype, or float8_e4m3fn for --kv-cache-dtype fp8_e4m3.
        self.kv_cache_dtype = torch.float8_e4m3fn if ex.kv_cache_dtype.itemsize == 1 else self.dtype
        self.is_hybrid_swa = False

        if ex.cfg.page_size != self.page_size:
            raise RuntimeError(f"SGLang page_size {self.page_size} != executor page size {ex.cfg.page_size}")
        self.max_total_num_tokens = ex.capacity_tokens
        requested = get_schedule().max_running_requests
        self.max_running_requests = min(
            requested or ex.config.scheduler.max_num_seqs, max(1, self.max_total_num_tokens // 2)
        )
        self.req_to_token_pool = ReqToTokenPool(
            size=self.max_running_requests,
            max_context_len=self.model_config.context_len,
            device="cpu",
            enable_memory_saver=False,
        )
        self.token_to_kv_pool = NoTorchKVCache(
            self.max_total_num_tokens, self.page_size, self.kv_cache_dtype, layers
        )
        if self.page_size == 1:
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
                size=self.max_total_num_tokens,
                dtype=self.kv_cache_dtype,
                device="cpu",
                kvcache=self.token_to_kv_pool,
                need_sort=False,
            )
        else:
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
                size=self.max_total_num_tokens,
                page_size=self.page_size,
                dtype=self.kv_cache_dtype,
                device="cpu",
                kvcache=self.token_to_kv_pool,
                need_sort=False,
            )
        self.decode_cuda_graph_runner = None
        self.attn_backend = None
        self.init_ngram_embedding_manager()
        log.info(
            "tpuserve: SGLang bookkeeping only (max_total_num_tokens=%d, page_size=%d, "
            "max_running_requests=%d, kv_cache_dtype=%s); torch KV pool bytes: 0; JAX KV "
            "cache %.1f MiB",
            self.max_total_num_tokens,
            self.page_size,
            self.max_running_requests,
            self.kv_cache_dtype,
            ex.kv_cache_bytes / 2**20,
        )

    def alloc_memory_pool(self, memory_pool_config=None, *, draft_parallel_layout=None):
        pass  # pools were made in initialize(); the KV itself is in JAX

    def init_attention_backends(self):
        self.attn_backend = None  # attention runs inside our JAX model

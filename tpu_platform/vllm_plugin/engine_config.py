"""The one mapping from vLLM's resolved configuration to our ``EngineConfig``.

Every value comes from vLLM's config objects (or the plugin's options): nothing here has a default
of its own, so vLLM's defaults are the plugin's. Imports neither vLLM nor torch (the objects are
read by attribute), so the main suite tests the mapping without vLLM installed.
"""

from __future__ import annotations

from typing import Any

from tpuserve.tpu_platform.config import ConfigError, EngineConfig
from tpuserve.tpu_platform.vllm_plugin.quantization import engine_quantization

# torch dtypes by their text (str(torch.float32) == "torch.float32"): no torch import needed.
_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def engine_config_from_vllm(
    model_config: Any,
    scheduler_config: Any,
    cache_config: Any,
    parallel_config: Any,
    options: Any,
    speculative_section: dict | None,
) -> EngineConfig:
    """Our engine's configuration for one vLLM worker.

    options: the plugin's ``PluginOptions`` (attention_impl, layer_loop, compilation_cache_dir);
    speculative_section: our ``speculative_config`` (``NgramSettings.engine_section()``) or None.
    """
    name = _DTYPE_NAMES.get(str(model_config.dtype))
    if name is None:
        raise ConfigError(
            f"dtype {model_config.dtype}: the tpuserve platform runs float32, bfloat16 or float16"
        )
    cache = cache_config
    # --kv-cache-dtype: auto or fp8 / fp8_e4m3 (platform.py refused the rest).
    kv_dtype = cache.cache_dtype if cache.cache_dtype not in (None, "auto") else "auto"
    return EngineConfig.from_kwargs(
        model=model_config.model,
        dtype=name,
        max_model_len=int(model_config.max_model_len),
        max_num_seqs=scheduler_config.max_num_seqs,
        max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        block_size=cache.block_size,
        seed=int(model_config.seed or 0),
        gpu_memory_utilization=float(cache.gpu_memory_utilization),
        kv_cache_memory_bytes=(
            int(cache.kv_cache_memory_bytes) if cache.kv_cache_memory_bytes is not None else None
        ),
        attention_impl=options.attention_impl,
        layer_loop=options.layer_loop,
        enable_chunked_prefill=bool(scheduler_config.enable_chunked_prefill),
        compilation_cache_dir=options.compilation_cache_dir,
        max_logprobs=min(max(int(model_config.max_logprobs), 0), 1024),
        async_scheduling=False,  # vLLM's scheduler drives the steps
        # --quantization on a dense checkpoint quantizes at load; a pre-quantized checkpoint's
        # format is the loader's to read (vLLM's name for it is the producer's).
        quantization=engine_quantization(model_config.model, model_config.quantization),
        kv_cache_dtype=kv_dtype,
        # One worker drives all N devices as SPMD; a ConfigError names the flag and the device
        # count when there are fewer (raised in init_device, so vLLM's start-up fails with it).
        tensor_parallel_size=int(parallel_config.tensor_parallel_size),
        # vLLM shards the experts over TP x DP devices; DP is refused here, so EP size = TP size.
        enable_expert_parallel=bool(parallel_config.enable_expert_parallel),
        speculative_config=speculative_section,
    )

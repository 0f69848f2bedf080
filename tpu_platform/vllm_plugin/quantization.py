"""``--quantization`` and ``--kv-cache-dtype`` on the tpuserve platform.

What vLLM does with them (vLLM 0.32), and what this module puts in its way:

* ``ModelConfig._verify_quantization`` reads the checkpoint's ``quantization_config`` (its
  ``quant_method``, possibly renamed by the quantization classes' ``override_quantization_method``,
  e.g. ModelOpt NVFP4 -> "modelopt_fp4"), checks the name is in vLLM's ``QUANTIZATION_METHODS`` and
  asks the platform's ``verify_quantization``. "nvfp4" is not one of vLLM's names, so the platform
  registers it (``register_quantization_config``), which is vLLM's hook for out-of-tree methods.
* ``VllmConfig.__post_init__`` then builds a quantization config *object* for the name
  (``get_quant_config``) and checks the model dtype against its ``get_supported_act_dtypes()``.
  vLLM's own classes are torch layer factories our worker never uses, and several refuse float32
  (the CPU default) or would route ``--quantization fp8`` / ``mxfp4`` to its online torch
  quantizer. So every name we serve is registered to ``TpuserveQuantConfig``: a marker that holds
  the method name, accepts the dtypes our runtime runs and builds no torch layers. The weights are
  loaded and (for an unquantized checkpoint) quantized by our own worker.

The runtime's side (``tpu_platform/config.py``, ``tpu_platform/worker.py``): ``--quantization`` fp8 /
mxfp4 / nvfp4 quantizes an unquantized checkpoint at load; a pre-quantized checkpoint's format is
detected by the loader (``loader/quantized.py::detect``) and the flag must then be unset or name it.
``--kv-cache-dtype fp8`` / ``fp8_e4m3``: an FP8 e4m3 KV cache with per-tensor k/v scales (the
checkpoint's, else calibrated at start-up).

This module imports neither vLLM's quantization package nor JAX at import time: platform.py loads
it while vLLM is still resolving its platform (vLLM's quantization package imports the resolved
platform), and in the API server process. ``TpuserveQuantConfig`` lives in quant_config.py. Only a
checkpoint that carries a quantization config makes the front end import our loader (and with it
JAX, without starting a backend) to ask ``detect``.
"""

from __future__ import annotations

from typing import Any

import torch

from tpuserve.tpu_platform.checkpoint_probe import checkpoint_quant
from tpuserve.tpu_platform.config import FP8_KV_CACHE_DTYPES, QUANTIZATION_METHODS
from tpuserve.tpu_platform.models.arch import ModelConfigError

# vLLM's names for what our loader reads off a pre-quantized checkpoint (loader/quantized.py):
# quant_method "fp8" (HF / DeepSeek block or per-tensor), "compressed-tensors" (FP8, NVFP4, MXFP4
# packs), ModelOpt ("modelopt"; vLLM renames NVFP4 ones "modelopt_fp4"), gpt-oss's MXFP4 experts
# ("mxfp4", renamed "gpt_oss_mxfp4" by vLLM). Which *formats* within these are readable is the
# loader's call (``detect``), asked at config time.
CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "modelopt", "modelopt_fp4", "gpt_oss_mxfp4")
# Every --quantization / model_config.quantization name the platform accepts.
SERVED_METHODS = tuple(dict.fromkeys((*QUANTIZATION_METHODS, *CHECKPOINT_METHODS)))
KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES)

_registered = False


def register_quant_configs() -> None:
    """Map every name in SERVED_METHODS to TpuserveQuantConfig in vLLM's registry (idempotent).

    Must run before vLLM builds the ModelConfig (the platform calls it from
    ``pre_register_and_update``, which vLLM runs first thing in ``create_engine_config``)."""
    global _registered
    if _registered:
        return
    # on call: vLLM's quantization package imports the resolved platform (module docstring)
    from vllm.model_executor.layers.quantization import register_quantization_config

    from tpuserve.tpu_platform.vllm_plugin.quant_config import TpuserveQuantConfig

    for name in SERVED_METHODS:
        register_quantization_config(name)(TpuserveQuantConfig)
    _registered = True


def refuse_method(quant: str) -> None:
    """``Platform.verify_quantization``: a clear refusal for a method we do not serve."""
    if quant not in SERVED_METHODS:
        raise ValueError(
            f"quantization {quant!r} is not supported on the tpuserve platform; it serves "
            f"{', '.join(QUANTIZATION_METHODS)} (an unquantized checkpoint, quantized at load) and "
            f"pre-quantized checkpoints in the fp8, compressed-tensors (FP8, NVFP4, MXFP4) and "
            f"ModelOpt (FP8, NVFP4) formats, and gpt-oss's published MXFP4 experts"
        )


def engine_quantization(model: str, method: str | None) -> str | None:
    """The ``quantization`` for our EngineConfig given vLLM's ``model_config.quantization``: the
    method itself on a dense checkpoint (quantize online); None on a pre-quantized one (the loader
    reads its format; vLLM's name there is the producer's, e.g. "compressed-tensors")."""
    if method is None or checkpoint_quant(model) is not None:
        return None
    return method


def unsupported_quantization(model_config: Any) -> list[str]:
    """Reasons (for ``_unsupported_config``) the checkpoint / ``--quantization`` pair cannot run."""
    method = model_config.quantization
    try:
        ckpt = checkpoint_quant(model_config.model)
    except ModelConfigError as e:
        return [f"this checkpoint's quantization ({e})"]
    if ckpt is not None:
        return []  # pre-quantized in a format the loader reads; vLLM checked the flag matches it
    if method is not None and method not in QUANTIZATION_METHODS:
        return [
            f"quantization={method!r} on an unquantized checkpoint (the tpuserve platform "
            f"quantizes online with {', '.join(QUANTIZATION_METHODS)})"
        ]
    return []


def unsupported_moe_quantization(arch: Any, model_config: Any) -> list[str]:
    """Reasons a mixture-of-experts model cannot take this ``--quantization``: its experts run in
    the checkpoint's own form (dense, or gpt-oss's published MXFP4), never quantized at load (the
    worker would refuse it at load; this says so before the engine starts)."""
    if arch.moe is None:
        return []
    try:
        method = engine_quantization(model_config.model, model_config.quantization)
    except ModelConfigError:
        return []  # the checkpoint's format is refused by unsupported_quantization already
    if method is None:
        return []
    return [
        f"quantization={method!r} with a mixture-of-experts model ({arch.architecture}): its "
        f"experts are served as the checkpoint stores them (dense, or gpt-oss's own MXFP4), "
        f"not quantized at load; drop --quantization"
    ]


def unsupported_kv_cache(cfg: Any) -> list[str]:
    """Reasons (for ``_unsupported_config``) the ``--kv-cache-dtype`` cannot run."""
    c = cfg.cache_config
    dtype = c.cache_dtype or "auto"
    if dtype not in KV_CACHE_DTYPES:
        return [
            f"kv_cache_dtype={dtype!r} (the tpuserve KV cache is the model dtype, 'auto', or "
            f"FP8 e4m3 with per-tensor scales: {', '.join(repr(d) for d in FP8_KV_CACHE_DTYPES)})"
        ]
    out = []
    if dtype != "auto" and getattr(c, "kv_cache_dtype_skip_layers", None):
        out.append(
            f"kv_cache_dtype_skip_layers={c.kv_cache_dtype_skip_layers} (one KV cache dtype for every layer)"
        )
    return out


def spec_dtype_and_mode(cache_dtype: str | None, model_dtype: torch.dtype, itemsize: int):
    """(torch dtype, vLLM KVQuantMode) for the worker's KV cache spec: what vLLM sizes a block by.

    itemsize: bytes per element of the worker's actual cache (1 for FP8)."""
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    if itemsize == 1:
        return torch.float8_e4m3fn, get_kv_quant_mode(cache_dtype or "fp8")
    return model_dtype, get_kv_quant_mode("auto")

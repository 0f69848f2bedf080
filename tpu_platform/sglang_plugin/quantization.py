"""``--quantization`` and ``--kv-cache-dtype`` on the tpuserve SGLang platform.

Our executor loads the weights itself, in JAX, so SGLang's torch quantization classes are never
built. What SGLang 0.5.23 does with the two flags, and where this module steps in:

* ``--quantization`` is an argparse choice (``arg_groups/choices.py::QUANTIZATION_CHOICES``: fp8 and
  mxfp4 are there, "nvfp4" is not; ``add_quantization_method_choices`` is the extension point for
  out-of-tree platforms, hooks.py uses it). SGLang then builds a ``ModelConfig`` (during argument
  resolution, in the tokenizer manager and in the scheduler) whose ``_verify_quantization`` reads
  the checkpoint's ``quantization_config``, renames it through every torch quantization class's
  ``override_quantization_method`` and requires the result to be one of *its* registered methods
  (on a CPU host "mxfp4" is not: "Unknown quantization method"). With our platform active that
  check is replaced by ``resolve_quantization`` (an AROUND hook, hooks.py): the checkpoint format
  is what our loader reads (``loader/quantized.py::detect``), and ``ModelConfig.quantization``
  becomes the method our worker will serve.
* ``--kv-cache-dtype`` choices are auto, fp8_e5m2, fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4 and
  fp4_mx_block16 (no plain "fp8"). Our KV cache is the model dtype or float8_e4m3fn with per-tensor
  k/v scales, so "auto" and "fp8_e4m3" are served; every other value is refused at start-up.

Served (``tpu_platform/config.py``, ``tpu_platform/worker.py``): ``--quantization fp8 | mxfp4 |
nvfp4`` quantizes an unquantized checkpoint once at load (W8A16 per-channel e4m3; e2m1 in 32-blocks
with e8m0 scales; e2m1 in 16-blocks with e4m3 scales and an f32 global), except on a
mixture-of-experts model, whose experts run as the checkpoint stores them (refused naming the flag
and the architecture). A pre-quantized checkpoint in a format the loader reads (fp8 / DeepSeek
block, compressed-tensors FP8 / NVFP4 / MXFP4, ModelOpt FP8 / NVFP4, gpt-oss's published MXFP4
experts) is served as it is; the flag may be unset, our method name, or SGLang's name for the
format. Anything else (awq, gptq, w8a8_int8, ...) is refused naming the flag and the value.

No SGLang import at module level: platform.py and the hooks import this in every SGLang process.
"""

from __future__ import annotations

import json
import logging
import os

from tpuserve.tpu_platform.checkpoint_probe import checkpoint_quant
from tpuserve.tpu_platform.config import QUANTIZATION_METHODS
from tpuserve.tpu_platform.models.arch import ModelArch, ModelConfigError

log = logging.getLogger(__name__)

# --quantization values that quantize an unquantized checkpoint at load (our runtime's names).
ONLINE_METHODS = QUANTIZATION_METHODS  # ("fp8", "mxfp4", "nvfp4")
# SGLang's names for the pre-quantized formats our loader reads, by (producer, our method).
_CHECKPOINT_NAMES = {
    ("fp8", "fp8"): ("fp8",),
    ("modelopt", "fp8"): ("modelopt", "modelopt_fp8"),
    ("modelopt", "nvfp4"): ("modelopt", "modelopt_fp4"),
}
_COMPRESSED_TENSORS_NAMES = ("compressed-tensors", "compressed_tensors")
CHECKPOINT_FORMATS = (
    "fp8 (HF / DeepSeek block or per-tensor)",
    "compressed-tensors (FP8, NVFP4, MXFP4)",
    "ModelOpt (FP8, NVFP4)",
    "gpt-oss's published MXFP4 experts",
)
# --kv-cache-dtype values served, in SGLang's spelling; our EngineConfig takes them as they are.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def supported_quantization_text() -> str:
    return (
        f"supported: {', '.join(ONLINE_METHODS)} (an unquantized checkpoint, quantized at load "
        f"in JAX), or unset for a pre-quantized checkpoint in a format tpuserve's loader reads: "
        f"{'; '.join(CHECKPOINT_FORMATS)}"
    )


def resolve_quantization(flag: str | None, model_path: str | None) -> str | None:
    """The weights' format our worker serves for ``--quantization flag`` on ``model_path``.

    Returns None (dense), a method to quantize with at load, or the pre-quantized checkpoint's own
    method (which our worker accepts as the flag: it must equal the checkpoint's). Raises
    ValueError naming the flag and its value for anything tpuserve does not serve."""
    flag = str(flag).lower() if flag else None
    try:
        ckpt = checkpoint_quant(model_path)
    except ModelConfigError as e:
        raise ValueError(
            f"the checkpoint at {model_path!r} is quantized in a format the tpuserve "
            f"SGLang platform cannot load ({e}); {supported_quantization_text()}"
        ) from e
    if ckpt is None:
        if flag is not None and flag in ONLINE_METHODS and (moe := _moe_architecture(model_path)):
            raise ValueError(
                f"--quantization {flag} with a mixture-of-experts model ({moe}) is not supported "
                f"by the tpuserve SGLang platform: its experts are served as the checkpoint "
                f"stores them (dense, or gpt-oss's own MXFP4), not quantized at load; drop "
                f"--quantization"
            )
        if flag is None or flag in ONLINE_METHODS:
            return flag
        raise ValueError(
            f"--quantization {flag} is not supported by the tpuserve SGLang platform "
            f"(the model runs in JAX; SGLang's torch quantization kernels are not "
            f"used); {supported_quantization_text()}"
        )
    names = {ckpt.method, *_CHECKPOINT_NAMES.get((ckpt.producer, ckpt.method), ())}
    if ckpt.producer == "compressed-tensors":
        names.update(_COMPRESSED_TENSORS_NAMES)
    if flag is None or flag in names:
        return ckpt.method
    raise ValueError(
        f"--quantization {flag} does not match the checkpoint at {model_path!r}, which "
        f"is pre-quantized as {ckpt.method} ({ckpt.producer} format) and is served as "
        f"it is: leave --quantization unset or pass one of {sorted(names)}"
    )


def _moe_architecture(model_path: str | None) -> str | None:
    """The architecture of the checkpoint at ``model_path`` when it is a mixture-of-experts model
    (read off its config.json, no weights); None otherwise, or when the loader will name what is
    wrong with it."""
    cfg_path = os.path.join(os.path.expanduser(str(model_path or "")), "config.json")
    if not model_path or not os.path.isfile(cfg_path):
        return None
    with open(cfg_path) as f:
        cfg = json.load(f)
    try:
        arch = ModelArch.from_hf_config(cfg)
    except ModelConfigError:
        return None
    return arch.architecture if arch.moe is not None else None


def engine_kv_cache_dtype(value: str | None) -> str:
    """Our EngineConfig's ``kv_cache_dtype`` for SGLang's ``--kv-cache-dtype`` (or a clear refusal)."""
    value = value or "auto"
    if value not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {value} is not supported by the tpuserve SGLang "
            f"platform; supported: auto (the model dtype) and fp8_e4m3 "
            f"(float8_e4m3fn with per-tensor k/v scales: the checkpoint's, else "
            f"calibrated at start-up)"
        )
    return value


def refuse_unsupported_flags(server_args) -> None:
    """Start-up checks for the launcher (platform.apply_server_args_defaults)."""
    resolve_quantization(getattr(server_args, "quantization", None), getattr(server_args, "model_path", None))
    engine_kv_cache_dtype(getattr(server_args, "kv_cache_dtype", None))
    if getattr(server_args, "quantization_param_path", None):
        raise ValueError(
            "--quantization-param-path is not supported by the tpuserve SGLang "
            "platform: an FP8 KV cache takes its k/v scales from the checkpoint, else "
            "calibrates them at start-up; drop the flag"
        )


def verify_model_config_quantization(model_config) -> None:
    """Stands in for SGLang's ``ModelConfig._verify_quantization`` when our platform is active."""
    flag = model_config.quantization
    method = resolve_quantization(flag, model_config.model_path)
    model_config.quantization = method
    if method is not None:
        log.info(
            "tpuserve: --quantization %s -> weights served as %s, loaded by tpuserve in JAX "
            "(SGLang's torch quantization classes are not used)",
            flag or "unset",
            method,
        )

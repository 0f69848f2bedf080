"""``TpuserveQuantConfig``: the quantization config object vLLM builds for the methods we serve.

Separate from quantization.py because it subclasses vLLM's ``QuantizationConfig``, whose package
imports vLLM's resolved platform: platform.py cannot import it at module level. vLLM pickles the
object to the engine core, which imports this module to unpickle it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

# gpt-oss's own MXFP4 experts: quant_method "mxfp4" in its config.json, which vLLM renames
# "gpt_oss_mxfp4" for that architecture (its model-specific config hook). Neither name says which
# architecture carries it, so TpuserveQuantConfig accepts them and the platform's check, which
# reads the whole config.json (quantization.unsupported_quantization), asks the loader about the
# model. (Here, not in quantization.py, which imports this module: no import cycle.)
GPT_OSS_MXFP4_METHODS = ("mxfp4", "gpt_oss_mxfp4")


class TpuserveQuantConfig(QuantizationConfig):
    """vLLM's quantization config object for the methods our runtime serves: a marker.

    vLLM builds one at config time for ``model_config.quantization`` and hands it around (pickled
    to the engine core); nothing on this platform asks it for torch layers: our worker loads the
    checkpoint itself. ``method`` is the checkpoint's ``quant_method`` when vLLM built it from the
    checkpoint's ``quantization_config``; None when it was built from a dense config.json (the
    online methods: the worker reads the method from ``model_config.quantization``).
    """

    def __init__(self, method: str | None = None):
        super().__init__()
        self.method = method

    def get_name(self) -> str:
        return self.method or "tpuserve"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]  # whatever our runtime runs

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # no CUDA kernels; our platform reports no device capability anyway

    @staticmethod
    def get_config_filenames() -> list[str]:
        # vLLM falls back to these files when the HF config carries no quantization_config (the
        # online methods on a dense checkpoint). An empty list would make it build its own online
        # torch config for "fp8" / "mxfp4" instead of ours. vLLM matches with ``path.endswith``:
        # the separator keeps it to config.json itself (not generation_config.json,
        # tokenizer_config.json, ...), which every HF checkpoint directory has.
        return [os.sep + "config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TpuserveQuantConfig:
        qm = config.get("quant_method")
        if qm is None:  # a whole config.json (dense checkpoint, online method)
            return cls(None)
        if str(qm).lower() in GPT_OSS_MXFP4_METHODS:
            # gpt-oss's own format: only the architecture, which this dict does not name, tells
            # it from an unreadable one; the platform checks the whole config.json
            # (quantization.unsupported_quantization) before the engine starts.
            return cls(str(qm).lower())
        # A checkpoint's quantization_config: refuse here, early and by name, a format the
        # loader would refuse at load (ModelConfigError is a ValueError). Imported here: the loader
        # package imports JAX, which a dense checkpoint's front-end process never needs.
        from tpuserve.tpu_platform.loader.quantized import detect

        detect({"quantization_config": config}, "")
        return cls(str(qm).lower())

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        raise NotImplementedError(
            "the tpuserve platform quantizes in its own JAX worker; vLLM's torch layers are never built on it"
        )

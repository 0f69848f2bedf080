"""tpuserve: a TPU-first LLM inference server on JAX and Pallas.

The user API: ``from tpuserve import LLM, SamplingParams``. Names resolve lazily so that importing
the package touches no device and loads no framework.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]

_EXPORTS = {
    "LLM": ("tpuserve.server.llm", "LLM"),
    "SamplingParams": ("tpuserve.server.sampling_params", "SamplingParams"),
    "EngineConfig": ("tpuserve.tpu_platform.config", "EngineConfig"),
    "RequestOutput": ("tpuserve.server.outputs", "RequestOutput"),
    "CompletionOutput": ("tpuserve.server.outputs", "CompletionOutput"),
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        module, attr = _EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'tpuserve' has no attribute {name!r}")

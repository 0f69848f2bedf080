"""tpuserve: a TPU-first LLM inference server on JAX and Pallas.

The user API: ``from tpuserve import LLM, SamplingParams``. Names resolve lazily so that importing
the package touches no device and loads no framework.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]

_EXPORTS = {
    "LLM": ("server.llm", "LLM"),
    "SamplingParams": ("server.sampling_params", "SamplingParams"),
    "EngineConfig": ("tpu_platform.config", "EngineConfig"),
    "RequestOutput": ("server.outputs", "RequestOutput"),
    "CompletionOutput": ("server.outputs", "CompletionOutput"),
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        module, attr = _EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'tpuserve' has no attribute {name!r}")

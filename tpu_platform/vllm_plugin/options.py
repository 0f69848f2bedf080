"""Settings of our runtime that vLLM has no flag for, read from ``--additional-config``.

vLLM passes ``--additional-config '{"...": ...}'`` (``LLM(additional_config={...})``) through to the
platform untouched; unknown keys are rejected here so a typo does not pass silently.

    attention_impl          one of attention.names.ATTENTION_IMPLS ("auto": Pallas on TPU/GPU,
                            the blocked jnp path on CPU)
    warmup                  compile every shape bucket before serving. Default: yes on TPU/GPU;
                            no on JAX's CPU backend (there the whole bucket grid takes minutes, so
                            each program compiles on first use and persists in the XLA cache) and
                            no under --enforce-eager, vLLM's "no ahead-of-time compilation"
    compilation_cache_dir   where XLA executables persist (default ~/.cache/tpuserve/xla)
    layer_loop              how the decoder runs its layers (config.LAYER_LOOPS): "scan" compiles
                            one layer body (fast start-up), "unroll" one straight-line program
                            (faster steps on CPU, ~7x the compile time); "auto": unroll on CPU,
                            scan elsewhere
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tpuserve.attention.names import ATTENTION_IMPLS
from tpuserve.tpu_platform.config import LAYER_LOOPS


@dataclass(frozen=True)
class PluginOptions:
    attention_impl: str = "auto"
    warmup: bool | None = None  # None: decided by the worker from the JAX backend
    compilation_cache_dir: str | None = None
    layer_loop: str = "auto"

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, enforce_eager: bool = False) -> PluginOptions:
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--additional-config: unknown key(s) {', '.join(unknown)} for the tpuserve "
                f"platform; known: {', '.join(sorted(known))}"
            )
        if enforce_eager and "warmup" not in raw:
            raw["warmup"] = False
        opts = cls(**raw)
        if opts.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"--additional-config attention_impl={opts.attention_impl!r}: must be one "
                f"of {ATTENTION_IMPLS}"
            )
        if opts.layer_loop not in LAYER_LOOPS:
            raise ValueError(
                f"--additional-config layer_loop={opts.layer_loop!r}: must be one of {LAYER_LOOPS}"
            )
        if opts.warmup is not None and not isinstance(opts.warmup, bool):
            raise ValueError(f"--additional-config warmup={opts.warmup!r}: must be true or false")
        return opts

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> PluginOptions:
        extra = vllm_config.additional_config
        if not isinstance(extra, dict):
            raise ValueError("--additional-config must be a JSON object for the tpuserve platform")
        return cls.from_dict(
            extra, enforce_eager=bool(vllm_config.model_config and vllm_config.model_config.enforce_eager)
        )

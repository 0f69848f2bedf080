"""SGLang platform plugin: SGLang's scheduler and radix cache over our JAX runtime.

Two entry points (pyproject.toml), both free of import-time side effects:
  * ``sglang.srt.platforms`` -> ``register_platform``: the platform's qualified name when it should
    be active (``SGLANG_PLATFORM=tpuserve``, or a TPU JAX could use), else None.
  * ``sglang.srt.plugins`` -> ``register_hooks``: puts our TP worker under SGLang's scheduler and
    makes ``--device tpu`` select this platform (hooks.py). The hooks act only when this platform
    is the one SGLang resolved.

Run it:
    python -m sglang.launch_server --model-path M --device tpu     # TPU host: active by itself
    SGLANG_PLATFORM=tpuserve python -m sglang.launch_server --model-path M   # any host, JAX default
SGLang picks its platform on ``import sglang``, before flags are parsed: ``--device tpu`` cannot
select a platform, it is served once this one is active (and refused clearly otherwise).

Modules: activation (when), platform (the SRTPlatform), hooks (HookRegistry wiring), worker (SGLang
batch -> our steps), stub_runner (SGLang's bookkeeping without torch weights or KV), executor (the
JAX side), slots (SGLang slot ids -> our page tables).
"""

from __future__ import annotations

# Imports wait for the calls: SGLang imports this package in every process, and hooks.py needs SGLang.


def register_platform() -> str | None:
    from tpuserve.tpu_platform.sglang_plugin.activation import PLATFORM_QUALNAME, platform_active

    return PLATFORM_QUALNAME if platform_active() else None


def register_hooks() -> None:
    from tpuserve.tpu_platform.sglang_plugin.hooks import register_all

    register_all()

"""vLLM platform plugin: vLLM's scheduler and KV manager over our JAX runtime.

Entry point (pyproject.toml, group ``vllm.platform_plugins``, name ``tpuserve``): :func:`register`.
Importing this package imports nothing from vLLM or JAX and touches no device; ``register`` decides
(see ``activation.py``) and returns the Platform class's qualified name, or None.
"""

from __future__ import annotations

import os

PLATFORM_QUALNAME = "tpuserve.tpu_platform.vllm_plugin.platform.TpuservePlatform"

# Why this process activated the platform (set by register, logged once logging is configured).
activation_reason: str | None = None


def register() -> str | None:
    """Called by vLLM in every process: our Platform's qualified name when active, else None."""
    # on call: importing the package (vLLM does, in every process) stays free of everything else
    from tpuserve.tpu_platform.vllm_plugin.activation import ENV_VAR, decide

    global activation_reason
    decision = decide()
    if not decision.active:
        return None
    if activation_reason is None:  # a later call would only see the variable pinned below
        activation_reason = decision.reason
    # An opt-in seen only on the command line (--device tpu) is pinned in the environment, so that
    # processes vLLM starts later with other command lines (engine core, API server workers) agree.
    os.environ[ENV_VAR] = "1"
    return PLATFORM_QUALNAME

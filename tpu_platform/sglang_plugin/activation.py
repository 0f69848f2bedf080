"""When the tpuserve SGLang platform is active: a TPU JAX could use, or an explicit opt-in. Never silently.

This runs in every SGLang process (launcher, tokenizer, scheduler, detokenizer) when SGLang resolves
its platform, so it must not initialise JAX: a TPU can be opened by one process only, and the
launcher grabbing it would lock the scheduler out. The TPU probe therefore looks for what JAX's TPU
backend needs - the ``libtpu`` package and TPU device nodes - without starting a backend.
"""

from __future__ import annotations

import glob
import importlib.util
import os

PLUGIN_NAME = "tpuserve"  # the entry-point name in both SGLang groups; SGLANG_PLATFORM=tpuserve
PLATFORM_QUALNAME = "tpuserve.tpu_platform.sglang_plugin.platform:TpuServeSRTPlatform"

# TPU VMs expose chips as /dev/accel* (v2-v5e) or VFIO groups (v5p, v6e and later).
_TPU_DEVICE_GLOBS = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


def explicitly_selected() -> bool:
    """The operator chose this platform: ``SGLANG_PLATFORM=tpuserve`` (SGLang's own selector)."""
    return os.environ.get("SGLANG_PLATFORM", "").strip() == PLUGIN_NAME


def tpu_visible() -> bool:
    """True when JAX could open a TPU here: libtpu installed and TPU device nodes present."""
    if importlib.util.find_spec("libtpu") is None:
        return False
    return any(glob.glob(pattern) for pattern in _TPU_DEVICE_GLOBS)


def platform_active() -> bool:
    return explicitly_selected() or tpu_visible()

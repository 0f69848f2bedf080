"""When the tpuserve vLLM platform is active: decided without importing vLLM or touching a device.

vLLM calls every ``vllm.platform_plugins`` entry point in every process it starts (the API server,
the engine core, workers) before it builds anything. So the decision must be cheap, must not open
an accelerator (a TPU chip can be held by one process only: initialising JAX in the API server would
take it away from the engine core), and must come out the same in every process.

Rules, first match wins:
  1. ``TPUSERVE_VLLM_PLATFORM=0`` (or false/off/no): never active.
  2. ``TPUSERVE_VLLM_PLATFORM=1`` (or true/on/yes): active, on whatever backend JAX picks
     (TPU, GPU or CPU; ``JAX_PLATFORMS`` narrows it as usual).
  3. ``--device tpu`` (or ``--device=tpu``) on the command line: active, and the choice is written
     to ``TPUSERVE_VLLM_PLATFORM=1`` so that processes vLLM spawns with other command lines agree.
  4. A TPU is attached (``libtpu`` installed and TPU device files present, which is what JAX itself
     needs to see a TPU): active.
  5. Otherwise: not active, and vLLM picks its own platform (CPU, CUDA, ...) as if we were absent.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

ENV_VAR = "TPUSERVE_VLLM_PLATFORM"
_ON = {"1", "true", "on", "yes"}
_OFF = {"0", "false", "off", "no"}
DEVICE_FLAG = "--device"
DEVICE_CHOICES = ("tpu",)


@dataclass(frozen=True)
class Activation:
    active: bool
    reason: str  # one line, for the log


def tpu_attached() -> bool:
    """True when JAX would find a TPU, judged without initialising any backend.

    TPU VMs expose chips as /dev/accel* (v2-v4) or /dev/vfio/<n> (v5e and later), and JAX reaches
    them through the libtpu package.
    """
    if importlib.util.find_spec("libtpu") is None:
        return False
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def device_flag_value(argv: list[str]) -> str | None:
    """The value given to ``--device`` in ``argv`` (last one wins), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == DEVICE_FLAG and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(DEVICE_FLAG + "="):
            value = arg.split("=", 1)[1]
    return value


def decide(
    environ: Mapping[str, str] | None = None, argv: list[str] | None = None, tpu: bool | None = None
) -> Activation:
    """Apply the rules in the module docstring. Arguments default to this process's state."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    setting = environ.get(ENV_VAR, "").strip().lower()
    if setting in _OFF:
        return Activation(False, f"{ENV_VAR}={setting} turns the tpuserve platform off")
    if setting in _ON:
        return Activation(True, f"{ENV_VAR}={setting}")
    if setting not in ("", "auto"):
        # An unknown value must not silently pick a platform either way.
        raise ValueError(f"{ENV_VAR} must be one of 1/0/true/false/on/off/auto, got {setting!r}")
    flag = device_flag_value(argv)
    if flag is not None and flag.lower() in DEVICE_CHOICES:
        return Activation(True, f"{DEVICE_FLAG} {flag} on the command line")
    if tpu if tpu is not None else tpu_attached():
        return Activation(True, "a TPU is attached")
    return Activation(False, f"no TPU attached and no opt-in ({ENV_VAR}=1 or {DEVICE_FLAG} tpu)")

"""The TPU runtime settings tpuserve chooses before the backend starts, and that a user's own
environment wins over them (their effect on start-up time is measured on the chip:
benchmarks/backend_init.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from tpuserve.tpu_platform.device import TPU_PREMAPPED_BUFFER_BYTES

CHILD = (
    "import os; from tpuserve.tpu_platform.device import discover; discover(); "
    "print(os.environ['TPU_PREMAPPED_BUFFER_SIZE'])"
)


def _buffer_size_after_discover(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TPU_PREMAPPED_BUFFER_SIZE"}
    if env_value is not None:
        env["TPU_PREMAPPED_BUFFER_SIZE"] = env_value
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_premapped_buffer_defaults_small_before_the_backend_starts():
    assert _buffer_size_after_discover(None) == str(TPU_PREMAPPED_BUFFER_BYTES)


def test_a_users_premapped_buffer_size_is_kept():
    assert _buffer_size_after_discover(str(4 << 30)) == str(4 << 30)

"""Run a test script in a child process whose JAX CPU backend has N fake devices.

The device count is fixed when jax first initializes, so a test that needs several devices runs
its body in a fresh interpreter with ``--xla_force_host_platform_device_count``.
"""

from __future__ import annotations

import os
import subprocess
import sys


def run_with_devices(script: str, *args: str, devices: int, timeout: float) -> str:
    """Run ``python script *args`` on ``devices`` fake CPU devices; returns its stdout and fails
    the calling test (with the child's output) when it exits non-zero."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
    res = subprocess.run(
        [sys.executable, script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(os.path.abspath(script)),
    )
    name = os.path.basename(script)
    assert res.returncode == 0, f"{name} {' '.join(args)} failed:\n{res.stdout}\n{res.stderr[-6000:]}"
    return res.stdout


def popen_with_devices(script: str, *args: str, devices: int) -> subprocess.Popen:
    """Start ``python script *args`` on ``devices`` fake CPU devices without waiting (several
    processes of one multi-host engine); stdout and stderr merged, as text."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
    return subprocess.Popen(
        [sys.executable, script, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=os.path.dirname(os.path.abspath(script)),
    )

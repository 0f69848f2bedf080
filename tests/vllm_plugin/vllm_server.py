"""Start ``vllm serve ... --device tpu`` (or ``tpuserve router``) in a child process for a test.

    with VllmServer.start([MODEL, "--max-model-len", "512", ...], log_path) as srv:
        srv.client.completions.create(...); srv.counters()

Each server runs in its own session so teardown stops it and the engine core it spawned. Nothing
here imports vLLM.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vllm_helpers import child_env

VLLM_CLI = os.path.join(os.path.dirname(sys.executable), "vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=300, max_retries=0)

    def log(self, tail: int = 6000) -> str:
        return self.log_path.read_text()[-tail:]

    def counters(self, labels: tuple[str, ...] = ()) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges, summed over labels (``name`` -> value). A sample
        carrying one of ``labels`` (e.g. ``'source="host"'``) also counts under ``name{label}``."""
        import httpx

        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            keys = [key] + [f"{key}{{{label}}}" for label in labels if label in name]
            for k in keys:
                out[k] = out.get(k, 0.0) + float(value)
        return out

    @classmethod
    def spawn(
        cls, cmd: list[str], log_path: Path, port: int, env: dict[str, str] | None = None
    ) -> VllmServer:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd,
                env=env or child_env(plugin=False),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(proc, port, Path(log_path))

    def wait_ready(self, timeout: float = 600, path: str = "/v1/models") -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited (rc={self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server did not come up in {timeout:.0f} s:\n{self.log()}")
            time.sleep(2)

    def wait_exit(self, timeout: float = 600) -> int:
        """For a server expected to fail at start-up: its exit code (it must exit, not hang)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"server still running after {timeout:.0f} s:\n{self.log()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def fake_devices_env(n: int) -> dict[str, str]:
    """Extra env giving JAX's CPU backend ``n`` devices (read once, when JAX starts in the engine
    core): appended to any XLA_FLAGS already set."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip()}


def serve_cmd(model: str, port: int, *args: str) -> list[str]:
    return [
        VLLM_CLI,
        "serve",
        model,
        "--device",
        "tpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "m",
        *args,
    ]


@contextmanager
def vllm_servers(specs: list[tuple[list[str], Path, dict[str, str] | None]]) -> Iterator[list[VllmServer]]:
    """Start several ``vllm serve`` processes at once (args after the model, log path, extra env);
    wait for all; stop all on exit. The model and port come first in each args list's place."""
    servers = []
    try:
        for args, log_path, env in specs:
            port = free_port()
            model, rest = args[0], args[1:]
            servers.append(
                VllmServer.spawn(
                    serve_cmd(model, port, *rest), log_path, port, child_env(plugin=False, **(env or {}))
                )
            )
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()

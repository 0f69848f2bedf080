"""Start an HTTP server in a child process and wait until it answers (tests and benchmarks).

``ServerProcess(argv, port)`` runs ``argv`` in its own process group, logs to a file, polls
``GET /health`` until 200 and stops with SIGTERM (then SIGKILL after a timeout).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tpuserve_argv(*args: str, python: str | None = None) -> list[str]:
    """argv running ``tpuserve <args>`` with this (or the given) interpreter."""
    return [python or sys.executable, "-m", "tpuserve.cli", *args]


class ServerProcess:
    def __init__(
        self,
        argv: list[str],
        port: int,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        log_path: str | None = None,
        startup_timeout: float = 600.0,
        health_path: str = "/health",
    ):
        self.argv = argv
        self.host, self.port = host, port
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path or tempfile.mkstemp(prefix="tpuserve-server-", suffix=".log")[1]
        self.startup_timeout = startup_timeout
        self.health_path = health_path
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        self.wait_ready()
        return self

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = self.base_url + self.health_path
        assert self.proc is not None, "wait_ready() follows start()"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(
            f"server not ready after {self.startup_timeout}s; log {self.log_path}:\n{self.log_tail()}"
        )

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL the process group. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

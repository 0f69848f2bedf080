"""Fixtures for the SGLang plugin tests. They run under the SGLang venv's python:

    "$(bash scripts/sglang_env.sh)" -m pytest tests/sglang_plugin

Under any other interpreter (the main test venv has no sglang) the SGLang-dependent tests skip; the
pure slot/step tests run everywhere. SGLang is never imported in the pytest process itself: it picks
its platform once per process on import, so every SGLang-side check runs in a subprocess whose
environment the test controls.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

HAS_SGLANG = importlib.util.find_spec("sglang") is not None

SERVER_START_TIMEOUT_S = 420  # import sglang (~25 s on 2 busy cores) + tokenizer + JAX model load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 240) -> str:
    """Run ``code`` with this interpreter in a fresh process (fresh SGLang platform resolution)."""
    full_env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLATFORM"}
    full_env.setdefault("JAX_PLATFORMS", "cpu")
    full_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if out.returncode != 0:
        raise AssertionError(f"subprocess failed ({out.returncode}):\n{out.stdout}\n{out.stderr[-4000:]}")
    return out.stdout


@pytest.fixture
def run_py():
    """``run_py(code, env)``: stdout of ``code`` run by this interpreter in a fresh process."""
    return run_python


@pytest.fixture(scope="session")
def hf_dir() -> str:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face directory, as SGLang reads it."""
    from tpuserve.tpu_platform.loader.export import default_model_hf_dir

    return default_model_hf_dir()


# SGLang's argument resolution as its launcher runs it (plugins, parse, resolve, ModelConfig), for a
# list of (model, extra args) cases in one child process: what each resolved to, or its error.
_RESOLVE = textwrap.dedent("""
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import prepare_server_args

    for model, extra in json.loads(sys.argv[1]):
        try:
            sa = prepare_server_args(["--model-path", model, *extra])
            sa.resolve_once()
            v = resolving_view(sa)
            mc = ModelConfig.from_server_args(sa)
            res = {"quantization": mc.quantization, "flag": v.quantization,
                   "kv_cache_dtype": v.kv_cache_dtype, "attention_backend": v.attention_backend,
                   "dtype": v.dtype, "architecture": mc.hf_config.architectures[0]}
        except SystemExit as e:
            res = {"error": f"argparse exit {e.code}"}
        except Exception as e:
            res = {"error": f"{type(e).__name__}: {e}"}
        print("RESULT" + json.dumps(res), flush=True)
""")


def resolve_server_args(cases: dict[str, tuple[str, list[str]]]) -> dict[str, dict]:
    """{name: (model path, extra launcher args)} -> {name: the resolved quantization, flag,
    kv_cache_dtype, attention_backend, dtype and architecture, or {"error": ...}}, resolved with
    our platform (SGLANG_PLATFORM=tpuserve) in one fresh process."""
    env = dict(os.environ, SGLANG_PLATFORM="tpuserve")
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE, json.dumps(list(cases.values()))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(ln[len("RESULT") :]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert len(lines) == len(cases), proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(zip(cases, lines))


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: str):
        self.proc, self.url, self.log_path = proc, url, log_path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def _wait_ready(server: Server, timeout: float) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"SGLang server exited with {server.proc.returncode}:\n{server.log()[-6000:]}")
        try:
            if requests.get(server.url + "/model_info", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"SGLang server not ready after {timeout}s:\n{server.log()[-6000:]}")


# The default model's 30 layers run in a scan in these tests' servers and reference engines: with a
# cold XLA cache (CI's) each program compiles one layer body instead of 30 copies. The unrolled CPU
# default is covered by the main suite; the platform only passes the choice through.
SCAN_ARGS = ["--model-loader-extra-config", '{"layer_loop": "scan"}']


@contextlib.contextmanager
def launch_sglang(hf_dir: str, log_path: str, *extra: str):
    """``python -m sglang.launch_server`` with the tpuserve platform selected (a ready ``Server``),
    stopped with every process it spawned on exit. ``extra``: more launcher flags."""
    port = _free_port()
    env = dict(os.environ, SGLANG_PLATFORM="tpuserve")
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        hf_dir,
        "--max-total-tokens",
        "4096",
        "--skip-server-warmup",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SCAN_ARGS,
        *extra,
    ]
    with open(log_path, "w") as log:
        # A session of its own, so teardown can stop the launcher and the processes it spawned.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        _wait_ready(server, SERVER_START_TIMEOUT_S)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.fixture(scope="session")
def sglang_server(hf_dir, tmp_path_factory):
    """The SGLang launcher with the tpuserve platform selected, on the default model."""
    if not HAS_SGLANG:
        pytest.skip("sglang is not installed in this venv")
    with launch_sglang(hf_dir, str(tmp_path_factory.mktemp("sglang") / "server.log")) as server:
        yield server


@pytest.fixture(scope="session")
def reference_llm(hf_dir):
    """Our standalone engine on the same weights (f32, as the server runs on CPU)."""
    from tpuserve.server.llm import LLM

    return LLM(hf_dir, dtype="float32", layer_loop="scan", warmup=False)

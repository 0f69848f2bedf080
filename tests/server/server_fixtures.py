"""Shared pieces of the HTTP tests (imported directly; pytest puts this folder on sys.path): one of
our servers in its own process, and an openai client."""

from __future__ import annotations

import openai

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv


def running_server(tmp_path_factory, name: str, *serve_args: str, env: dict | None = None):
    """Generator for a module fixture: ``tpuserve serve *serve_args`` on a free port (JAX on CPU,
    plus ``env``), yielded once ready; on teardown it must exit cleanly."""
    port = free_port()
    log = str(tmp_path_factory.mktemp(name) / "server.log")
    srv = ServerProcess(
        tpuserve_argv("serve", *serve_args, "--port", str(port)),
        port,
        env={"JAX_PLATFORMS": "cpu", **(env or {})},
        log_path=log,
    )
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

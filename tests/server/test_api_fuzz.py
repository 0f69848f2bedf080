"""Schemathesis fuzzing against the server's own OpenAPI schema: no request, valid or not, may get a
5xx answer or take the server down. Bounded (a fixed number of examples per operation, no example
database) so that it runs in a couple of minutes on two CPU cores."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402  (schemathesis brings hypothesis)

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

EXAMPLES_PER_OPERATION = 15


def fuzz_target_server(random_checkpoints, tmp_path_factory, name: str):
    """A real server for fuzzing (generator: yields it, then checks it outlived the fuzzing)."""
    port = free_port()
    log = str(tmp_path_factory.mktemp(name) / "server.log")
    # A short context bounds the work any one generated request can ask for.
    srv = ServerProcess(
        tpuserve_argv(
            "serve",
            random_checkpoints["qwen3"],
            "--port",
            str(port),
            "--no-warmup",
            "--max-model-len",
            "48",
            "--max-num-batched-tokens",
            "64",
            "--max-num-seqs",
            "32",
            "--max-body-bytes",
            str(256 * 1024),
        ),
        port,
        env={"JAX_PLATFORMS": "cpu"},
        log_path=log,
    )
    srv.start()
    yield srv
    alive = srv.proc.poll() is None
    rc = srv.stop()
    assert alive, f"the server died during fuzzing:\n{srv.log_tail()}"
    assert rc == 0, srv.log_tail()


@pytest.fixture(scope="module")
def server(random_checkpoints, tmp_path_factory):
    yield from fuzz_target_server(random_checkpoints, tmp_path_factory, "fuzz-server")


def _bounded(body):
    """Keep generated requests cheap: at most 2 choices of at most 2 tokens each (validation is what
    is being fuzzed, not generation). Every other field, and any invalid value of these, goes to the
    server as generated."""
    if isinstance(body, dict):
        body = dict(body)
        if isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 1 + body["n"] % 2
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > 2:
                body[key] = 1 + body[key] % 2
        if (
            "messages" in body
            and body.get("max_tokens") is None
            and body.get("max_completion_tokens") is None
        ):
            body["max_tokens"] = 2
        if isinstance(body.get("best_of"), int) and body["best_of"] > 2:
            body["best_of"] = 1 + body["best_of"] % 2
    return body


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors(case, server):
    case.body = _bounded(case.body)
    response = case.call(base_url=server.base_url, timeout=120)
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
        f"body: {str(case.body)[:500]}\n{server.log_tail(20)}"
    )
    if response.status_code >= 400:
        err = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(err)


def test_server_still_healthy_after_fuzzing(server):
    assert httpx.get(server.base_url + "/health").status_code == 200

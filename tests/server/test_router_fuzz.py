"""Schemathesis fuzzing of ``tpuserve router`` in front of a real server: no request, valid or not,
may get a 5xx from the router (its backend is up, so a 502/503/504 would be a router bug too) or
take it down, and every error is in the OpenAI shape. The router forwards raw JSON and has no request
models, so its own OpenAPI schema says nothing about bodies: the server's schema (the same routes)
drives the fuzzing. Bounded as test_api_fuzz.py is."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402  (schemathesis brings hypothesis)
from test_api_fuzz import EXAMPLES_PER_OPERATION, _bounded, fuzz_target_server  # noqa: E402  (tests/server/test_api_fuzz.py)

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module")
def backend(random_checkpoints, tmp_path_factory):
    """One server as both the prefill and the decode backend (the router does not care)."""
    yield from fuzz_target_server(random_checkpoints, tmp_path_factory, "router-fuzz-server")


@pytest.fixture(scope="module")
def router(backend, tmp_path_factory):
    port = free_port()
    log = str(tmp_path_factory.mktemp("router-fuzz-router") / "router.log")
    # A long health interval: a check that happens to time out while the CPU is busy must not mark
    # the only backend unhealthy (a 503 that says nothing about the request fuzzed).
    proc = ServerProcess(
        tpuserve_argv(
            "router",
            "--prefill",
            backend.base_url,
            "--decode",
            backend.base_url,
            "--port",
            str(port),
            "--health-interval",
            "3600",
        ),
        port,
        log_path=log,
        startup_timeout=120,
    )
    proc.start()
    yield proc
    alive = proc.proc.poll() is None
    proc.stop()
    assert alive, f"the router died during fuzzing:\n{proc.log_tail()}"


@pytest.fixture(scope="module")
def router_schema(backend, router):
    return schemathesis.openapi.from_url(backend.base_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("router_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_no_router_errors(case, router, backend):
    case.body = _bounded(case.body)
    response = case.call(base_url=router.base_url, timeout=120)
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
        f"body: {str(case.body)[:500]}\nrouter log:\n{router.log_tail(20)}\n"
        f"server log:\n{backend.log_tail(20)}"
    )
    if response.status_code >= 400:
        err = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(err), response.text[:500]


# Bodies no schema generates. Each once made the router answer 500 (plain text): an integer over
# Python's 4,300-digit limit (json.loads raises a bare ValueError) and a body nested just under the
# decoder's depth limit (re-encoding it for the backends, a few frames deeper, hit RecursionError).
RAW_BODIES = {
    "huge integer": b'{"model": "m", "prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}",
    **{f"nested {depth}": b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}" for depth in range(900, 1001)},
}


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_raw_bodies_get_4xx_in_the_error_shape(router, backend, path):
    wrong = []
    for name, body in RAW_BODIES.items():
        for who, target in (("router", router), ("server", backend)):
            r = httpx.post(
                target.base_url + path, content=body, headers={"content-type": "application/json"}, timeout=60
            )
            shaped = r.headers.get("content-type") == "application/json" and set(
                r.json().get("error", {})
            ) == {"message", "type", "param", "code"}
            if not (400 <= r.status_code < 500 and shaped):
                wrong.append(f"{who} {name}: {r.status_code} {r.text[:200]}")
    assert not wrong, "\n".join(wrong)


def test_router_and_backend_still_healthy_after_fuzzing(router, backend):
    assert httpx.get(backend.base_url + "/health").status_code == 200
    assert httpx.get(router.base_url + "/health").status_code == 200

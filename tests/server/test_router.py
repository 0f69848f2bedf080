"""``tpuserve router``: what it sends to prefill and decode servers (mocked backends, in process),
and end to end over two real ``tpuserve serve`` processes (tiny random Qwen3) as P and D.

Oracle for the end-to-end tests: the same request sent straight to a server, greedy.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from polling import wait_until  # tests/polling.py

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv
from tpuserve.server.router import BackendPool, RouterConfig, build_router_app

pytestmark = pytest.mark.timeout(300)

P1, P2, D1 = "http://p1:1", "http://p2:2", "http://d1:3"


# ---- in process, mocked backends ----


class Backends:
    """A mock transport: records every request; ``dead`` hosts refuse connections."""

    def __init__(self, kv_params: dict | None = None):
        self.seen: list[tuple[str, str, dict | None]] = []
        self.dead: set[str] = set()
        self.kv_params = kv_params

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content) if request.content else None
        self.seen.append((host, request.url.path, body))
        if request.url.path == "/health":
            return httpx.Response(200)
        if host.startswith("p"):
            out = {"choices": [{"text": "x"}]}
            if self.kv_params is not None:
                out["kv_transfer_params"] = self.kv_params
            return httpx.Response(200, json=out)
        if body.get("stream"):
            return httpx.Response(
                200,
                content=b'data: {"a": 1}\n\ndata: [DONE]\n\n',
                headers={"content-type": "text/event-stream"},
            )
        return httpx.Response(200, json={"from": host, "choices": [{"text": "decoded"}]})

    def posts(self):
        return [(h, p, b) for h, p, b in self.seen if p != "/health"]


def _client(backends: Backends, prefill=(P1,), decode=(D1,), **kw) -> TestClient:
    cfg = RouterConfig(list(prefill), list(decode), health_interval_s=3600, **kw)
    return TestClient(build_router_app(cfg, transport=httpx.MockTransport(backends)))


def test_prefill_gets_one_token_and_decode_gets_the_prefills_kv_params():
    kv = {"do_remote_prefill": True, "remote_transfer_id": "abc"}
    b = Backends(kv_params=kv)
    with _client(b) as c:
        body = {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 9,
            "stream": False,
            "kv_transfer_params": {"client": "must not pass"},
        }
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["from"] == "d1"
    (p_host, p_path, p_body), (d_host, d_path, d_body) = b.posts()
    assert (p_host, p_path, d_host, d_path) == ("p1", "/v1/completions", "d1", "/v1/completions")
    assert p_body == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert d_body == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 9,
        "stream": False,
        "kv_transfer_params": kv,
    }


def test_without_kv_params_from_prefill_decode_gets_the_plain_request():
    b = Backends()
    with _client(b) as c:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    (_, _, p_body), (_, _, d_body) = b.posts()
    assert p_body["max_completion_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body
    assert d_body == body


def test_round_robin_and_failover_to_the_next_prefill():
    b = Backends()
    with _client(b, prefill=(P1, P2)) as c:
        for _ in range(4):
            assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert [h for h, _, _ in b.posts()][::2] == ["p1", "p2", "p1", "p2"]
        b.seen.clear()
        b.dead.add("p1")
        for _ in range(3):
            assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert [h for h, _, _ in b.posts()][::2] == ["p2", "p2", "p2"]
        state = c.get("/router/backends").json()
        assert [x["healthy"] for x in state["prefill"]] == [False, True]


def test_dead_backends_give_502_then_503_as_json():
    b = Backends()
    with _client(b) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        b.dead.add("d1")  # dies after the health check at start-up (the next is an hour away)
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 502 and "no decode server reachable" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "x"})  # now known unhealthy: not tried
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert r.headers["retry-after"]
        assert c.get("/health").status_code == 503


def test_prefill_4xx_is_passed_through_and_bad_json_is_400():
    def handler(request):
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(400, json={"error": {"message": "bad temperature", "code": 400}})

    cfg = RouterConfig([P1], [D1], health_interval_s=3600)
    with TestClient(build_router_app(cfg, transport=httpx.MockTransport(handler))) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "temperature": -1})
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad temperature"
        assert c.post("/v1/completions", content=b"{nope").status_code == 400


def _openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_client_mistakes_get_the_servers_error_shape_not_a_500():
    """A lone surrogate (sent as JSON escapes) once made the router 500 (UnicodeEncodeError when it
    re-encoded the body) and 10,000 nested arrays 500 (RecursionError); unknown routes answered
    FastAPI's {"detail": ...}."""
    b = Backends()
    with _client(b) as c:
        r = c.post(
            "/v1/completions",
            content=b'{"prompt": "bad \\ud800 text", "max_tokens": 2}',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 200  # forwarded for the server to judge (it answers 400)
        (_, _, p_body), (_, _, d_body) = b.posts()
        assert p_body["prompt"] == d_body["prompt"] == "bad \ud800 text"
        deep = b"[" * 10_000 + b"]" * 10_000
        assert "nested too deeply" in _openai_error(c.post("/v1/completions", content=deep), 400)["message"]
        assert "no route GET /nope" in _openai_error(c.get("/nope"), 404)["message"]
        _openai_error(c.get("/v1/completions"), 405)


def test_tokenize_and_detokenize_go_to_a_decode_server_and_metrics_are_the_routers():
    b = Backends()
    with _client(b, prefill=(P1, P2)) as c:
        assert c.post("/tokenize", json={"prompt": "hi"}).json()["from"] == "d1"
        assert c.post("/detokenize", json={"tokens": [1]}).json()["from"] == "d1"
        assert [(h, p) for h, p, _ in b.posts()] == [("d1", "/tokenize"), ("d1", "/detokenize")]
        _openai_error(c.post("/tokenize", content=b"{nope"), 400)
        c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        text = c.get("/metrics").text
    assert 'tpuserve_router_backend_healthy{role="prefill",url="http://p2:2"} 1' in text
    assert 'tpuserve_router_backend_requests_total{role="decode",url="http://d1:3"} 3' in text


def test_health_checks_revive_a_backend():
    b = Backends()
    cfg = RouterConfig([P1], [D1], health_interval_s=0.1)
    with TestClient(build_router_app(cfg, transport=httpx.MockTransport(b))) as c:
        b.dead.add("p1")
        wait_until(lambda: c.get("/health").status_code == 503, 30, every_s=0.05, what="unhealthy")
        b.dead.clear()
        wait_until(lambda: c.get("/health").status_code == 200, 30, every_s=0.05, what="revived")


def test_pool_and_config_validation():
    pool = BackendPool.of("prefill", ["http://a/", "http://b"])
    assert [b.url for b in pool.candidates()] == ["http://a", "http://b"]
    assert [b.url for b in pool.candidates()] == ["http://b", "http://a"]
    with pytest.raises(ValueError, match="--decode"):
        RouterConfig(["http://a"], []).validate()
    with pytest.raises(ValueError, match="not an http"):
        RouterConfig(["a:80"], ["http://b"]).validate()


# ---- end to end: two real servers and the router CLI, each in its own process ----

ENGINE_FLAGS = [
    "--served-model-name",
    "tiny",
    "--no-warmup",
    "--max-model-len",
    "256",
    "--max-num-batched-tokens",
    "64",
    "--max-num-seqs",
    "8",
]


@pytest.fixture(scope="module")
def servers(random_checkpoints, tmp_path_factory):
    """(prefill, decode, router) ServerProcesses; the prefill one is killed by the last test."""
    logs = tmp_path_factory.mktemp("router")
    procs = []
    try:
        for name in ("prefill", "decode"):
            port = free_port()
            procs.append(
                ServerProcess(
                    tpuserve_argv("serve", random_checkpoints["qwen3"], *ENGINE_FLAGS, "--port", str(port)),
                    port,
                    env={"JAX_PLATFORMS": "cpu"},
                    log_path=str(logs / f"{name}.log"),
                )
            )
        for p in procs:  # start both before waiting: they load in parallel
            with open(p.log_path, "wb") as log:
                p.proc = subprocess.Popen(
                    p.argv, stdout=log, stderr=subprocess.STDOUT, env=p.env, start_new_session=True
                )
        for p in procs:
            p.wait_ready()
        port = free_port()
        router = ServerProcess(
            tpuserve_argv(
                "router",
                "--prefill",
                procs[0].base_url,
                "--decode",
                procs[1].base_url,
                "--port",
                str(port),
                "--health-interval",
                "0.5",
            ),
            port,
            log_path=str(logs / "router.log"),
            startup_timeout=120,
        )
        router.start()
        procs.append(router)
        yield tuple(procs)
    finally:
        for p in reversed(procs):
            p.stop()


GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "Hello there, how are", "1 2 3 4 5 6"]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def test_greedy_completions_through_the_router_equal_a_direct_request(servers):
    _, decode, router = servers
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, **GREEDY}
        via, direct = (
            _post(router.base_url, "/v1/completions", body),
            _post(decode.base_url, "/v1/completions", body),
        )
        assert via.status_code == 200, via.text
        assert via.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
        assert via.json()["usage"] == direct.json()["usage"]
        assert via.json()["usage"]["completion_tokens"] == 12
    seen = httpx.get(router.base_url + "/router/backends").json()
    assert seen["prefill"][0]["requests"] >= 3 and seen["decode"][0]["requests"] >= 3


def test_chat_through_the_router_equals_a_direct_request(servers):
    prefill, _, router = servers
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 10,
        **GREEDY,
    }
    via, direct = (
        _post(router.base_url, "/v1/chat/completions", body),
        _post(prefill.base_url, "/v1/chat/completions", body),
    )
    assert via.status_code == 200, via.text
    assert via.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]


def test_streaming_passes_through(servers):
    _, _, router = servers
    body = {"model": "tiny", "prompt": "Streaming test", "max_tokens": 10, **GREEDY}
    whole = _post(router.base_url, "/v1/completions", body).json()["choices"][0]["text"]
    chunks = []
    with httpx.stream(
        "POST",
        router.base_url + "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert len(events) > 2
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole
    assert events[-1]["usage"]["completion_tokens"] == 10


def test_router_models_and_health(servers):
    _, _, router = servers
    assert [m["id"] for m in httpx.get(router.base_url + "/v1/models").json()["data"]] == ["tiny"]
    assert httpx.get(router.base_url + "/health").status_code == 200


def test_killed_prefill_server_gives_502_or_503_quickly(servers):
    """Runs last in this module: it kills the prefill server."""
    prefill, _, router = servers
    prefill.signal(signal.SIGKILL)
    prefill.proc.wait(10)
    body = {"model": "tiny", "prompt": "anyone there", "max_tokens": 4, **GREEDY}
    for _ in range(2):  # first unreachable (502, or 503 if the health check saw it first), then 503
        t0 = time.monotonic()
        r = _post(router.base_url, "/v1/completions", body)
        assert time.monotonic() - t0 < 5
        assert r.status_code in (502, 503), r.text
        assert "prefill" in r.json()["error"]["message"]
    assert r.status_code == 503
    assert httpx.get(router.base_url + "/health").status_code == 503

"""``tpuserve router --policy prefix``: prefix affinity, load bound, health, the in-flight count and
the index's bound (mocked backends, in process, no model)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from tpuserve.server.router import BackendPool, PrefixIndex, RouterConfig, build_router_app, chunk_hashes

pytestmark = pytest.mark.timeout(60)

R = ["http://r0:1", "http://r1:2", "http://r2:3", "http://r3:4"]
SYSTEM = [f"system prompt {k}: " + "you are a careful assistant. " * 40 for k in range(4)]


class Replicas:
    """A mock transport recording which replica got each completion; ``fail`` hosts answer 500,
    ``dead`` ones refuse connections."""

    def __init__(self):
        self.got: list[tuple[str, dict]] = []
        self.dead: set[str] = set()
        self.fail: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.dead:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        self.got.append((host, body))
        if host in self.fail:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        if body.get("stream"):
            return httpx.Response(
                200, content=b"data: {}\n\ndata: [DONE]\n\n", headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, json={"from": host})


def _client(replicas: Replicas, **kw) -> TestClient:
    cfg = RouterConfig([], list(R), health_interval_s=3600, policy="prefix", **kw)
    return TestClient(build_router_app(cfg, transport=httpx.MockTransport(replicas)))


def _in_flight(c: TestClient) -> list[int]:
    return [b["in_flight"] for b in c.get("/router/backends").json()["decode"]]


def test_shared_prefixes_stick_to_one_replica_and_distinct_ones_spread():
    reps = Replicas()
    with _client(reps) as c:
        for i in range(3):
            for k in range(4):
                r = c.post("/v1/completions", json={"model": "m", "prompt": SYSTEM[k] + f"question {i}"})
                assert r.status_code == 200
        by_group: dict[int, set[str]] = {}
        for host, body in reps.got:
            by_group.setdefault(int(body["prompt"].split(":")[0].split()[-1]), set()).add(host)
        assert all(len(h) == 1 for h in by_group.values()), by_group  # affinity
        assert len(set().union(*by_group.values())) == 4  # the 4 groups went to 4 replicas
        state = c.get("/router/backends").json()["decode"]
        assert sum(b["prefix_hits"] for b in state) == 8  # every repeat was a hit
        assert (
            'tpuserve_router_backend_prefix_hits_total{role="decode",url="http://r0:1"}'
            in c.get("/metrics").text
        )
        # chat: the same leading system message is the same prefix
        msgs = [{"role": "system", "content": SYSTEM[0]}]
        for q in ("a", "b"):
            c.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [*msgs, {"role": "user", "content": q}]},
            )
        assert reps.got[-1][0] == reps.got[-2][0]


def test_round_robin_policy_still_spreads_a_shared_prefix():
    reps = Replicas()
    cfg = RouterConfig([], list(R), health_interval_s=3600)
    with TestClient(build_router_app(cfg, transport=httpx.MockTransport(reps))) as c:
        for i in range(4):
            c.post("/v1/completions", json={"prompt": SYSTEM[0] + str(i)})
    assert len({h for h, _ in reps.got}) == 4


def test_a_loaded_replica_is_passed_over_past_the_threshold():
    pool = BackendPool.of("decode", R[:2])
    pool.index, pool.load_threshold = PrefixIndex(100), 2
    hashes = chunk_hashes(SYSTEM[0], 64)
    pool.index.record(hashes, R[0])
    pool.backends[0].in_flight = 2  # at the threshold: still preferred
    assert pool.candidates(hashes)[0].url == R[0]
    pool.backends[0].in_flight = 3  # over it: the least loaded instead
    assert pool.candidates(hashes)[0].url == R[1]
    assert pool.candidates(chunk_hashes(SYSTEM[1], 64))[0].url == R[1]  # no match: least loaded


def test_a_dead_replica_is_skipped_and_its_prefix_moves():
    reps = Replicas()
    with _client(reps) as c:
        c.post("/v1/completions", json={"prompt": SYSTEM[0] + "1"})
        first = reps.got[-1][0]
        reps.dead.add(first)
        r = c.post("/v1/completions", json={"prompt": SYSTEM[0] + "2"})
        assert r.status_code == 200 and reps.got[-1][0] != first
        c.post("/v1/completions", json={"prompt": SYSTEM[0] + "3"})
        assert reps.got[-1][0] == reps.got[-2][0]  # the new holder keeps it


def test_in_flight_returns_to_zero_after_success_stream_error_and_refusal():
    reps = Replicas()
    with _client(reps) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert r.text.endswith("[DONE]\n\n")
        reps.fail.update({"r0", "r1", "r2", "r3"})
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 500
        assert c.post("/v1/completions", json={"prompt": "x", "stream": True}).status_code == 500
        reps.fail.clear()
        reps.dead.update({"r0", "r1"})
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert _in_flight(c) == [0, 0, 0, 0]


def test_in_flight_returns_to_zero_when_the_client_leaves_mid_stream():
    asyncio.run(_client_leaves_mid_stream())


async def _client_leaves_mid_stream():
    started = asyncio.Event()

    async def endless():
        started.set()
        while True:
            yield b"data: {}\n\n"
            await asyncio.sleep(0.01)

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, content=endless(), headers={"content-type": "text/event-stream"})

    cfg = RouterConfig([], R[:1], health_interval_s=3600, policy="prefix")
    app = build_router_app(cfg, transport=httpx.MockTransport(handler))
    backend = app.state.pools["decode"].backends[0]
    sent = []
    disconnect = asyncio.Event()

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b'{"prompt": "x", "stream": true}', "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            disconnect.set()  # the client goes after the first chunk

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("t", 1),
        "server": ("t", 2),
        "scheme": "http",
        "root_path": "",
    }
    router = app.router
    async with router.lifespan_context(app):
        await asyncio.wait_for(app(scope, receive, send), 10)
        assert started.is_set()
        assert backend.in_flight == 0


def test_the_index_stays_within_its_bound():
    idx = PrefixIndex(10)
    for k in range(50):
        idx.record(chunk_hashes(f"{k} " + "y" * 300, 16), R[k % 4])
        assert len(idx) <= 10
    # chained: a shared chunk after a different one is a different prefix
    a, b = chunk_hashes("A" * 16 + "C" * 16, 16), chunk_hashes("B" * 16 + "C" * 16, 16)
    assert a[1] != b[1]


def test_config_validation():
    with pytest.raises(ValueError, match="--policy"):
        RouterConfig([], ["http://a"], policy="random").validate()
    with pytest.raises(ValueError, match="--decode"):
        RouterConfig(["http://a"], []).validate()

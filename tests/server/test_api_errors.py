"""Errors in OpenAI's shape with the right status (400/401/404/413/503) and graceful SIGTERM, against
a real ``tpuserve serve`` process started with --api-key, a small body limit and a tiny queue."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv

pytestmark = pytest.mark.timeout(300)

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(random_checkpoints, tmp_path_factory):
    port = free_port()
    log = str(tmp_path_factory.mktemp("err-server") / "server.log")
    srv = ServerProcess(
        tpuserve_argv(
            "serve",
            random_checkpoints["qwen3"],
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--served-model-name",
            "tiny",
            "--max-body-bytes",
            str(MAX_BODY),
            "--max-waiting-requests",
            "2",
            "--no-warmup",
            "--max-model-len",
            "128",
            "--max-num-batched-tokens",
            "32",
            "--max-num-seqs",
            "1",
        ),
        port,
        env={"JAX_PLATFORMS": "cpu"},
        log_path=log,
    )
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def _assert_error(r: httpx.Response, status: int, param: str | None = "", contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if param != "":
        assert err["param"] == param, err
    if contains:
        assert contains in err["message"], err
    return err


def _v1_routes(base: str) -> list[tuple[str, str]]:
    spec = httpx.get(base + "/openapi.json").json()
    routes = [
        (method.upper(), path)
        for path, ops in spec["paths"].items()
        for method in ops
        if path.startswith("/v1")
    ]
    assert ("POST", "/v1/completions") in routes and ("GET", "/v1/models") in routes
    return routes + [("GET", "/v1/no-such-route"), ("POST", "/v1/embeddings")]


def test_api_key_required_on_every_v1_route(server):
    base = server.base_url
    for method, path in _v1_routes(base):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, base + path, headers=headers, json={})
            err = _assert_error(r, 401)
            assert err["type"] == "AuthenticationError"
    # Liveness and the version stay open; with the key the API works through the openai client.
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/version").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id == "tiny"


KEYED_ROUTES = [
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/metrics", None),
]


@pytest.mark.parametrize("method, path, body", KEYED_ROUTES)
def test_api_key_required_on_tokenizer_and_metrics_routes(server, method, path, body):
    url = server.base_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, url, headers=headers, json=body)
        assert _assert_error(r, 401)["type"] == "AuthenticationError"
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.request(method, url, headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    if path == "/metrics":
        assert "vllm:num_requests_running" in r.text
    else:
        assert r.json()


LONG = "word " * 300  # over max_model_len=128 tokens

BAD_COMPLETIONS = [
    ({"prompt": LONG}, "prompt", "maximum context length"),
    ({"prompt": list(range(1, 200))}, "prompt", ""),
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens", "maximum context length"),
    ({"prompt": "hi", "temperature": -1}, "temperature", ""),
    ({"prompt": "hi", "top_p": 0}, "top_p", ""),
    ({"prompt": "hi", "n": 0}, "n", ""),
    ({"prompt": "hi", "n": 100000}, "n", ""),
    ({"prompt": "hi", "logprobs": 50}, "logprobs", ""),
    ({"prompt": "hi", "presence_penalty": 5}, "presence_penalty", ""),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens", ""),
    ({"prompt": "hi", "stop": ["x"] * 100}, "stop", ""),
    ({"prompt": "hi", "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", ""),
    (
        {
            "prompt": "hi",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            },
        },
        "response_format",
        "does not compile",
    ),
    ({"prompt": "hi", "guided_regex": "("}, None, "does not compile"),
    ({"prompt": []}, "prompt", ""),
    ({"prompt": [10**9]}, "prompt", "vocabulary"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", ""),
    ({"max_tokens": 3}, "prompt", ""),
]


def test_prompt_over_the_character_limit_is_400_before_tokenizing(server):
    # max_model_len=128 x 32 characters per token (the default) = 4096 characters.
    text = "x" * 5000
    base = server.base_url
    r = httpx.post(base + "/v1/completions", json={"prompt": text}, headers=AUTH)
    _assert_error(r, 400, "prompt", "limit of 4096 characters")
    r = httpx.post(base + "/v1/completions", json={"prompt": ["ok", text]}, headers=AUTH)
    _assert_error(r, 400, "prompt", "--max-prompt-chars-per-token")
    r = httpx.post(
        base + "/v1/chat/completions", headers=AUTH, json={"messages": [{"role": "user", "content": text}]}
    )
    _assert_error(r, 400, "messages", "limit of 4096 characters")
    r = httpx.post(base + "/tokenize", json={"prompt": text}, headers=AUTH)
    _assert_error(r, 400, "prompt", "limit of 4096 characters")
    # The rendered chat counts too: messages just under the limit, plus the template's own text.
    near = [{"role": "user", "content": "y" * 2040}, {"role": "user", "content": "y" * 2040}]
    r = httpx.post(base + "/tokenize", json={"messages": near}, headers=AUTH)
    _assert_error(r, 400, "messages", "rendered chat")


@pytest.mark.parametrize("body, param, contains", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(server, body, param, contains):
    r = httpx.post(server.base_url + "/v1/completions", json=body, headers=AUTH)
    err = _assert_error(r, 400, param if param else "", contains)
    assert err["type"] == "BadRequestError"


MSG = [{"role": "user", "content": "hi"}]
BAD_CHATS = [
    ({"messages": [{"role": "user", "content": LONG}]}, None, "maximum context length"),
    ({"messages": []}, "messages", ""),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None, ""),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages",
        "only text",
    ),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs", ""),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice", ""),
    (
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
        "no tool named",
    ),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format", ""),
    ({}, "messages", ""),
]


@pytest.mark.parametrize("body, param, contains", BAD_CHATS)
def test_bad_chat_requests_are_400(server, body, param, contains):
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=AUTH)
    _assert_error(r, 400, param if param else "", contains)


def test_malformed_bodies_are_400(server):
    url = server.base_url + "/v1/chat/completions"
    for content in (b"{not json", b"[1, 2]", b"null", b'"text"'):
        r = httpx.post(url, content=content, headers={**AUTH, "content-type": "application/json"})
        _assert_error(r, 400)
    # Python's JSON parser accepts NaN and Infinity; sampling parameters must be finite.
    for value in (b"NaN", b"Infinity", b"-Infinity"):
        content = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + value + b"}"
        r = httpx.post(url, content=content, headers={**AUTH, "content-type": "application/json"})
        _assert_error(r, 400, "temperature")


def test_unknown_model_and_route_are_404(server):
    base = server.base_url
    r = httpx.post(base + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"}, headers=AUTH)
    _assert_error(r, 404, "model", "gpt-9")
    r = httpx.post(base + "/v1/chat/completions", json={"model": "gpt-9", "messages": MSG}, headers=AUTH)
    _assert_error(r, 404, "model")
    _assert_error(httpx.get(base + "/v1/no-such-route", headers=AUTH), 404)
    _assert_error(httpx.post(base + "/nope", json={}, headers=AUTH), 404)
    _assert_error(httpx.post(base + "/nope", json={}), 401)  # with a key, closed unless listed open
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")


def test_body_too_large_is_413(server):
    url = server.base_url + "/v1/completions"
    big = {"prompt": "a" * (MAX_BODY + 10), "max_tokens": 1}
    _assert_error(httpx.post(url, json=big, headers=AUTH), 413)

    def chunked():  # no Content-Length: the limit applies while the body is read
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"a" * 1024
        yield b'"}'

    r = httpx.post(url, content=chunked(), headers={**AUTH, "content-type": "application/json"})
    _assert_error(r, 413)


def test_full_waiting_queue_is_503(server):
    # One running slot (--max-num-seqs 1) and room for 2 waiting requests: of 8 concurrent
    # requests some must be refused with 503; every accepted one completes.
    url = server.base_url + "/v1/completions"
    body = {"prompt": "queue", "max_tokens": 40, "ignore_eos": True, "temperature": 0}

    def post(_):
        return httpx.post(url, json=body, headers=AUTH, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(post, range(8)))
    codes = sorted(r.status_code for r in results)
    assert 503 in codes and 200 in codes, codes
    assert set(codes) <= {200, 503}
    for r in results:
        if r.status_code == 503:
            assert _assert_error(r, 503)["type"] == "ServiceUnavailableError"
            assert int(r.headers["retry-after"]) >= 1  # every 503 says when to come back
        else:
            assert r.json()["usage"]["completion_tokens"] == 40
    # The queue drains: a new request is served.
    assert post(0).status_code == 200


@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests_and_exits_zero(random_checkpoints, tmp_path):
    port = free_port()
    srv = ServerProcess(
        tpuserve_argv(
            "serve",
            random_checkpoints["qwen3"],
            "--port",
            str(port),
            "--no-warmup",
            "--max-model-len",
            "128",
            "--max-num-batched-tokens",
            "32",
            "--max-num-seqs",
            "4",
            "--shutdown-timeout",
            "60",
        ),
        port,
        env={"JAX_PLATFORMS": "cpu"},
        log_path=str(tmp_path / "server.log"),
    )
    srv.start()
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        started = threading.Event()
        result: dict = {}

        def stream():
            chunks = []
            for chunk in client.completions.create(
                model=random_checkpoints["qwen3"],
                prompt="go",
                max_tokens=50,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                chunks.append(chunk)
                started.set()
            result["chunks"] = chunks

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        srv.signal(signal.SIGTERM)
        t.join(120)
        assert not t.is_alive()
        chunks = result["chunks"]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        rc = srv.proc.wait(60)
        assert rc == 0, srv.log_tail()
        # Exited (and reaped): its listening socket is closed already, nothing to wait for.
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.base_url + "/health")
    finally:
        srv.stop()

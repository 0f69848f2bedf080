"""Adversarial clients against a real ``tpuserve serve`` process (tiny random Qwen3, real tokenizer):
lone surrogates, prompts of megabytes, and a 503 from an engine that died (which must say when to
retry)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from polling import wait_until  # tests/polling.py
from server_fixtures import openai_client, running_server  # tests/server/server_fixtures.py

from tpuserve.server.launcher import free_port

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
MAX_MODEL_LEN = 512
CHARS_PER_TOKEN = 8000  # -> a limit of 4,096,000 characters: big prompts get to the tokenizer
LIMIT = MAX_MODEL_LEN * CHARS_PER_TOKEN


@pytest.fixture(scope="module")
def server(random_checkpoints, tmp_path_factory):
    yield from running_server(
        tmp_path_factory,
        "adversarial-server",
        random_checkpoints["qwen3"],
        "--served-model-name",
        MODEL,
        "--no-warmup",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-batched-tokens",
        "64",
        "--max-num-seqs",
        "4",
        "--max-prompt-chars-per-token",
        str(CHARS_PER_TOKEN),
    )


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _raw_post(base: str, path: str, body: str) -> httpx.Response:
    """POST JSON text as written: ``json.dumps`` escapes a lone surrogate as ``\\ud800``, which is
    how a client (or an attacker) sends one."""
    return httpx.post(
        base + path, content=body.encode("ascii"), headers={"content-type": "application/json"}, timeout=120
    )


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


LONE = "bad \ud800 text"

SURROGATE_CASES = [
    ("/v1/completions", {"model": MODEL, "prompt": LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["fine", LONE], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [LONE], "max_tokens": 2}, "stop"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": LONE}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
        "messages.0.content.list[ContentPart].0.text",
    ),
    ("/v1/chat/completions", {"model": LONE, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/tokenize", {"prompt": "\udfff"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
]


@pytest.mark.parametrize("path, body, param", SURROGATE_CASES)
def test_lone_surrogate_is_400_naming_the_field(server, path, body, param):
    r = _raw_post(server.base_url, path, json.dumps(body))
    err = _error(r, 400)
    assert err["type"] == "BadRequestError"
    assert err["param"] == param, err
    assert "surrogate" in err["message"] and err["message"].startswith(param), err
    # The server goes on serving.
    ok = httpx.post(server.base_url + "/tokenize", json={"prompt": "still fine"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["count"] > 0


def test_surrogate_as_raw_utf8_bytes_and_valid_astral_text(server, client):
    # The bytes ED A0 80 (U+D800 encoded as if it were a character): Python's JSON parser lets them
    # through as a lone surrogate too.
    body = b'{"model": "tiny", "prompt": "x \xed\xa0\x80 y", "max_tokens": 2}'
    r = httpx.post(
        server.base_url + "/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
    # The openai client refuses to encode a lone surrogate itself; a valid astral character (a
    # surrogate *pair* in JSON) goes through it and is served.
    r = client.completions.create(model=MODEL, prompt="smile \U0001f600", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert (
        _raw_post(server.base_url, "/tokenize", json.dumps({"prompt": "smile \U0001f600"})).status_code == 200
    )


class _Upload:
    """A JSON request body for httpx that sets ``sent`` once its last byte is handed to the socket:
    from then on the server holds the whole request, and the client is no longer sending it."""

    def __init__(self, body: dict):
        self.data = json.dumps(body).encode()
        self.sent = threading.Event()
        # A length, so that the body goes as it would from httpx's json= (not chunked).
        self.headers = {"content-type": "application/json", "content-length": str(len(self.data))}

    def __iter__(self):
        yield self.data
        self.sent.set()  # httpx asks for more only once the last chunk is written


def test_huge_prompt_does_not_stall_small_requests(server, client):
    def small():
        r = client.completions.create(
            model=MODEL, prompt="hello", max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 2
        return time.monotonic()

    small()  # compiles the small shapes: later timings see a warm server
    # Within the character limit, so the server tokenizes all of it (seconds on a CPU) and then
    # finds it longer than max_model_len.
    huge = {"model": MODEL, "prompt": "hello world " * (4_000_000 // 12), "max_tokens": 2}
    assert len(huge["prompt"]) <= LIMIT
    upload = _Upload(huge)
    done: dict = {}

    def send_huge():
        t0 = time.monotonic()
        done["response"] = httpx.post(
            server.base_url + "/v1/completions", content=upload, headers=upload.headers, timeout=300
        )
        done["elapsed"] = time.monotonic() - t0
        done["at"] = time.monotonic()

    t = threading.Thread(target=send_huge)
    t.start()
    assert upload.sent.wait(60)  # the server has the huge prompt (and tokenizes it) from now on
    small_done_at = [small() for _ in range(3)][-1]
    t.join(300)
    assert not t.is_alive()
    err = _error(done["response"], 400)
    assert "maximum context length" in err["message"], err
    # Three small requests, sent while the huge one was in flight, all finished before it.
    assert small_done_at < done["at"], (small_done_at, done["at"])

    # Over the character limit: refused before tokenizing, so much sooner than the in-limit
    # prompt above (which had 2.5x fewer characters to tokenize).
    over = "hello world " * (10_000_000 // 12)
    for path, body, param in (
        ("/v1/completions", {"model": MODEL, "prompt": over}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": over}]},
            "messages",
        ),
        ("/tokenize", {"prompt": over}, "prompt"),
    ):
        t0 = time.monotonic()
        r = httpx.post(server.base_url + path, json=body, timeout=300)
        elapsed = time.monotonic() - t0
        err = _error(r, 400)
        assert err["param"] == param and str(LIMIT) in err["message"], err
        assert "--max-prompt-chars-per-token" in err["message"]
        assert elapsed < done["elapsed"] / 2, (path, elapsed, done["elapsed"])


def test_concurrent_huge_prompts_leave_small_ones_alone(server, client):
    """Two huge prompts queue on the bulk lane behind each other; small ones still pass them."""
    body = {"model": MODEL, "prompt": "spam " * 600_000, "max_tokens": 2}

    def post(path, payload: dict | _Upload):
        if isinstance(payload, _Upload):
            r = httpx.post(server.base_url + path, content=payload, headers=payload.headers, timeout=300)
        else:
            r = httpx.post(server.base_url + path, json=payload, timeout=300)
        return r, time.monotonic()

    uploads = [_Upload(body) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(post, "/v1/completions", u) for u in uploads]
        assert all(u.sent.wait(60) for u in uploads)  # both huge prompts are the server's now
        r, small_at = post("/tokenize", {"prompt": "tiny"})
        assert r.status_code == 200
        for f in futs:
            big, big_at = f.result()
            _error(big, 400)
            assert small_at < big_at  # the small request waited for neither


def test_megabyte_stop_string_is_a_quick_400_and_the_server_lives_on(server, client):
    """A 1 MB stop string once took the server 65 s and 20 GB before the OOM killer ended it
    (every prefix of every stop string was stored)."""
    for stop in (["x" * 1_000_000], ["y" * 4000] * 5):
        t0 = time.monotonic()
        r = httpx.post(
            server.base_url + "/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": stop},
        )
        err = _error(r, 400)
        assert time.monotonic() - t0 < 10
        assert err["param"] == "stop" and "characters" in err["message"]
        assert len(err["message"]) < 300  # the value is not echoed back
    # The longest stop strings allowed still work, and the server still answers.
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stop=["z" * 4096] * 4)
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": [True, False]}, "prompt"),  # lax parsing read these as token ids 1 and 0
        ({"prompt": [[1, True]]}, "prompt"),
        ({"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids"),
    ],
)
def test_token_ids_are_integers_inside_the_vocabulary(server, body, param):
    r = httpx.post(
        server.base_url + "/v1/completions", timeout=60, json={"model": MODEL, "max_tokens": 2, **body}
    )
    # A union field's param carries the member that failed first ("prompt.str").
    assert _error(r, 400)["param"].split(".")[0] == param


NO_TEXT = [{"regex": "[^\\s\\S]"}, {"json": {"$ref": "#"}}, {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("so", NO_TEXT, ids=["regex", "ref-loop", "ebnf"])
def test_grammar_that_matches_nothing_is_400_before_any_token(server, so, stream):
    r = httpx.post(
        server.base_url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": stream, "structured_outputs": so},
    )
    assert "matches no text" in _error(r, 400)["message"]


def test_deeply_nested_schema_is_a_quick_400_and_small_requests_keep_their_pace(server, client):
    """A json_schema of 900 nested arrays (~25 KB) once took 27 s to compile, and 8 small
    completions sent meanwhile (0.1 s each) took 25-27 s: the compile held the one lane their
    tokenization needed. Now the schema is refused at once and the small ones run at their pace."""

    def small():
        t0 = time.monotonic()
        r = client.completions.create(
            model=MODEL, prompt="hello", max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 2
        return time.monotonic() - t0

    usual = max(small() for _ in range(3))
    schema: dict = {"type": "string"}
    for _ in range(900):
        schema = {"type": "array", "items": schema}
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}},
        }
    )
    with ThreadPoolExecutor(9) as pool:
        t0 = time.monotonic()
        deep = pool.submit(_raw_post, server.base_url, "/v1/completions", body)
        smalls = [pool.submit(small) for _ in range(8)]
        r = deep.result()
        deep_s = time.monotonic() - t0
        times = [f.result() for f in smalls]
    err = _error(r, 400)
    assert "nested 901 levels deep" in err["message"] and err["param"] == "response_format", err
    assert deep_s < 10, deep_s
    # 8 at once on a 4-sequence engine: a few rounds of the usual, nowhere near 25 s.
    assert max(times) < 8 * usual + 5, (times, usual)


def test_grammar_dead_end_while_decoding_ends_the_request_with_a_400(server, client):
    """'a' is admitted, then nothing: found only while decoding; the request ends with a clear
    error (not a 500), streamed as an error event, and the server serves the next request."""
    so = {"grammar": 'root ::= "a" [^\\x00-\\U0010FFFF]'}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0, "structured_outputs": so}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert "matches no complete text" in _error(r, 400)["message"]
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: {")]
    errors = [json.loads(e[6:])["error"] for e in events if '"error"' in e]
    assert errors and errors[0]["code"] == 400 and "matches no complete text" in errors[0]["message"]
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


# ---- a 503 from an engine whose loop died: in-process server, fake engine ----


class _DyingEngine:
    """Just enough of LLMEngine for AsyncEngine; its step fails, which stops the engine loop."""

    def __init__(self):
        self.tokenizer = None
        self.max_model_len = 64
        self.arch = SimpleNamespace(vocab_size=100)
        self.requests: dict = {}
        self.pool = SimpleNamespace(num_free=10, num_usable=10, usage=lambda: 0.0)
        from tpuserve.server.engine import EngineStats

        self.stats = EngineStats()
        self.scheduler = SimpleNamespace(waiting=[])
        self.num_running = self.num_waiting = 0

    def add_request(self, rid, prompt, params, prompt_token_ids=None, **extra):
        self.requests[rid] = params

    def abort_request(self, rid):
        self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        raise RuntimeError("device lost")


def test_every_503_has_retry_after():
    import uvicorn

    from tpuserve.server.api_server import build_app
    from tpuserve.server.async_engine import AsyncEngine

    app = build_app(AsyncEngine(_DyingEngine()), MODEL)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: server.started, 60, every_s=0.05, what="uvicorn started")
        assert httpx.get(base + "/health").status_code == 200
        # The first request kills the engine loop: it fails, mid-request (a 500 or an error answer).
        httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
        wait_until(
            lambda: httpx.get(base + "/health").status_code == 503, 60, every_s=0.05, what="/health 503"
        )
        for method, path, body in (
            ("GET", "/health", None),
            ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}),
        ):
            r = httpx.request(method, base + path, json=body, timeout=60)
            err = _error(r, 503)
            assert err["type"] == "ServiceUnavailableError"
            assert int(r.headers["retry-after"]) >= 1, (path, r.headers)
    finally:
        server.should_exit = True
        thread.join(30)

"""Slow and stalled clients (--http-header-timeout, --http-body-timeout) against real ``tpuserve serve``
and ``tpuserve router`` processes, driven with raw sockets: a request head or body that does not
arrive in time costs the server one connection for the deadline, never more, and never delays
anyone else; a slow *reader* of a streamed answer is not cut."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_fixtures import openai_client, running_server  # tests/server/server_fixtures.py

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
# The protocol closes a body that is still unread this long after the 408 was due.
BACKSTOP_S = BODY_TIMEOUT_S + 1.0
# How late past a deadline a cut may come (CI has 2 busy cores).
SLACK_S = 10.0
DEADLINE_FLAGS = ["--http-header-timeout", str(HEADER_TIMEOUT_S), "--http-body-timeout", str(BODY_TIMEOUT_S)]
MODEL = "tiny"
COMPLETION = {
    "model": MODEL,
    "prompt": "Hello there",
    "max_tokens": 4,
    "temperature": 0.0,
    "ignore_eos": True,
}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(random_checkpoints, tmp_path_factory):
    gen = running_server(
        tmp_path_factory,
        "slow-clients-server",
        random_checkpoints["qwen3"],
        "--served-model-name",
        MODEL,
        "--no-warmup",
        "--max-model-len",
        "128",
        "--max-num-batched-tokens",
        "64",
        "--max-num-seqs",
        "8",
        *DEADLINE_FLAGS,
    )
    srv = next(gen)
    try:
        # Compile the completion shapes now, so that "promptly" below measures serving, not XLA.
        _complete(srv.base_url)
        yield srv
    finally:
        next(gen, None)  # stops it; asserts a clean exit


@pytest.fixture(scope="module")
def router(server, tmp_path_factory):
    """A router with the same deadlines, in front of ``server`` (as both prefill and decode)."""
    port = free_port()
    log = str(tmp_path_factory.mktemp("slow-clients-router") / "router.log")
    proc = ServerProcess(
        tpuserve_argv(
            "router",
            "--prefill",
            server.base_url,
            "--decode",
            server.base_url,
            "--port",
            str(port),
            "--health-interval",
            "0.5",
            *DEADLINE_FLAGS,
        ),
        port,
        log_path=log,
        startup_timeout=120,
    )
    proc.start()
    yield proc
    proc.stop()


def _complete(base_url: str) -> float:
    """One normal completion; returns how long it took."""
    t0 = time.monotonic()
    r = httpx.post(base_url + "/v1/completions", json=COMPLETION, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == COMPLETION["max_tokens"]
    return time.monotonic() - t0


def _connect(srv: ServerProcess) -> socket.socket:
    return socket.create_connection((srv.host, srv.port), timeout=10)


def _head(path: str, content_length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _until_closed(
    sock: socket.socket, limit_s: float, trickle: bytes = b"", every_s: float = 0.5
) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (monotonic),
    sending the next byte of ``trickle`` every ``every_s`` meanwhile (a client that is slow, not
    silent). Fails if the connection is still open after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    got = b""
    while True:
        now = time.monotonic()
        if now >= deadline:
            raise AssertionError(f"the connection is still open after {limit_s}s; got {got[:300]!r}")
        sock.settimeout(min(every_s, deadline - now) if trickle else deadline - now)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            if trickle:
                try:
                    sock.sendall(trickle[:1])
                except (BrokenPipeError, ConnectionResetError):
                    return got, time.monotonic()
                trickle = trickle[1:]
            continue
        except ConnectionResetError:
            return got, time.monotonic()
        if not chunk:
            return got, time.monotonic()
        got += chunk


def _split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def _read_response(sock: socket.socket, limit_s: float = 120) -> bytes:
    """One whole response with a Content-Length body, the connection left open."""
    sock.settimeout(limit_s)
    got = b""
    while True:
        if b"\r\n\r\n" in got:
            _, headers, body = _split_response(got)
            if len(body) >= int(headers["content-length"]):
                return got
        chunk = sock.recv(65536)
        assert chunk, f"closed before the whole response came: {got[:300]!r}"
        got += chunk


def _assert_cut_in_time(t0: float, closed_at: float, deadline_s: float) -> None:
    elapsed = closed_at - t0
    # Not before the deadline (the server may start its clock a moment after t0, never before).
    assert deadline_s - 0.05 <= elapsed <= deadline_s + SLACK_S, elapsed


# ---- the request head ----

STALLED_HEADS = {
    "silent": b"",
    "half a head": b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Ty",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sent", list(STALLED_HEADS.values()), ids=list(STALLED_HEADS))
def test_a_stalled_head_is_cut_after_the_header_deadline(server, sent):
    t0 = time.monotonic()
    sock = _connect(server)
    sock.sendall(sent)
    _complete(server.base_url)  # meanwhile, a normal request is served normally
    got, closed_at = _until_closed(sock, HEADER_TIMEOUT_S + SLACK_S)
    assert got == b""  # closed without an answer: there is no request to answer
    _assert_cut_in_time(t0, closed_at, HEADER_TIMEOUT_S)
    sock.close()


@pytest.mark.timeout(120)
def test_a_head_sent_a_byte_at_a_time_is_cut_after_the_header_deadline(server):
    """Slowloris proper: bytes keep coming, but the head never completes in time."""
    t0 = time.monotonic()
    sock = _connect(server)
    got, closed_at = _until_closed(sock, HEADER_TIMEOUT_S + SLACK_S, trickle=_head("/health"), every_s=0.2)
    assert got == b""
    _assert_cut_in_time(t0, closed_at, HEADER_TIMEOUT_S)
    sock.close()


@pytest.mark.timeout(120)
def test_the_next_keep_alive_head_has_its_own_deadline(server):
    """After a first request, the second head's deadline runs from its first byte: a connection idle
    between requests is left to uvicorn's keep-alive timeout (5 s, longer than the header deadline)."""
    sock = _connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    assert _split_response(_read_response(sock))[0] == 200
    time.sleep(HEADER_TIMEOUT_S + 0.5)  # idle past the header deadline: still open
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    assert _split_response(_read_response(sock))[0] == 200
    t0 = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    got, closed_at = _until_closed(sock, HEADER_TIMEOUT_S + SLACK_S)
    assert got == b""
    _assert_cut_in_time(t0, closed_at, HEADER_TIMEOUT_S)
    sock.close()


# ---- the request body ----


@pytest.mark.timeout(120)
def test_a_stalled_body_gets_408_after_the_body_deadline(server):
    t0 = time.monotonic()
    sock = _connect(server)
    sock.sendall(_head("/v1/completions", content_length=1000) + json.dumps(COMPLETION).encode()[:10])
    _complete(server.base_url)
    got, closed_at = _until_closed(sock, BODY_TIMEOUT_S + SLACK_S)
    status, headers, body = _split_response(got)
    assert status == 408, got
    assert headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 408
    assert err["type"] == "RequestTimeoutError" and "did not arrive" in err["message"]
    _assert_cut_in_time(t0, closed_at, BODY_TIMEOUT_S)
    sock.close()


@pytest.mark.timeout(120)
def test_a_body_nobody_reads_is_still_cut(server):
    """A route that answers without reading the body (here a 404): the client trickling the rest of
    its body would otherwise hold the connection; it is closed at the body deadline (+1 s)."""
    t0 = time.monotonic()
    sock = _connect(server)
    sock.sendall(_head("/nope", content_length=1000) + b"x" * 10)
    got, closed_at = _until_closed(sock, BACKSTOP_S + SLACK_S, trickle=b"y" * 990, every_s=0.5)
    status, _, body = _split_response(got)
    assert status == 404 and json.loads(body)["error"]["code"] == 404
    _assert_cut_in_time(t0, closed_at, BACKSTOP_S)
    sock.close()


@pytest.mark.timeout(120)
def test_a_slow_body_within_the_deadline_is_served(server):
    body = json.dumps(COMPLETION).encode()
    sock = _connect(server)
    sock.sendall(_head("/v1/completions", content_length=len(body)))
    for i in range(0, len(body), len(body) // 3 + 1):  # in three pieces, 0.5 s apart
        time.sleep(0.5)
        sock.sendall(body[i : i + len(body) // 3 + 1])
    got = _read_response(sock)
    status, _, answer = _split_response(got)
    assert status == 200, got
    assert json.loads(answer)["usage"]["completion_tokens"] == COMPLETION["max_tokens"]
    sock.close()


# ---- many at once; slow readers ----


@pytest.mark.timeout(180)
def test_fifty_stalled_clients_do_not_delay_a_normal_request(server):
    sockets: list[tuple[socket.socket, bool]] = []
    t0 = time.monotonic()
    for i in range(50):
        sock = _connect(server)
        if i % 2:
            sock.sendall(STALLED_HEADS["half a head"])
        else:
            sock.sendall(_head("/v1/completions", content_length=1000) + b'{"model": ')
        sockets.append((sock, bool(i % 2)))
    took = _complete(server.base_url)
    assert took < 30, took
    for sock, head_only in sockets:
        got, closed_at = _until_closed(sock, BODY_TIMEOUT_S + SLACK_S)
        if head_only:
            assert got == b""
            _assert_cut_in_time(t0, closed_at, HEADER_TIMEOUT_S)
        else:
            assert _split_response(got)[0] == 408, got
            _assert_cut_in_time(t0, closed_at, BODY_TIMEOUT_S)
        sock.close()
    _complete(server.base_url)


@pytest.mark.timeout(120)
def test_a_slow_reader_of_a_stream_is_not_cut(server):
    """The deadlines bound reading the request only: pausing past both mid-stream loses nothing."""
    body = {**COMPLETION, "max_tokens": 16, "stream": True}
    events = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                break
        time.sleep(BACKSTOP_S + 1.0)
        events += [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"] is not None) >= 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- the router ----


@pytest.mark.timeout(120)
def test_router_cuts_a_stalled_head_and_408s_a_stalled_body(router):
    t0 = time.monotonic()
    head = _connect(router)
    head.sendall(STALLED_HEADS["half a head"])
    body = _connect(router)
    body.sendall(_head("/v1/completions", content_length=1000) + b'{"model": ')
    _complete(router.base_url)  # meanwhile, through the router to the server
    got, closed_at = _until_closed(head, HEADER_TIMEOUT_S + SLACK_S)
    assert got == b""
    _assert_cut_in_time(t0, closed_at, HEADER_TIMEOUT_S)
    got, closed_at = _until_closed(body, BODY_TIMEOUT_S + SLACK_S)
    status, headers, answer = _split_response(got)
    assert status == 408 and headers["connection"] == "close", got
    assert set(json.loads(answer)["error"]) == {"message", "type", "param", "code"}
    _assert_cut_in_time(t0, closed_at, BODY_TIMEOUT_S)
    head.close()
    body.close()


def test_openai_client_through_the_deadlines(server):
    """The official client (head and body in separate writes) is unaffected."""
    r = openai_client(server).completions.create(
        model=MODEL, prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3


def test_deadline_flags_must_be_positive(capsys):
    from tpuserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--http-header-timeout", "0"])
    assert exit_.value.code == 2 and "--http-header-timeout" in capsys.readouterr().err
    rc = main(["router", "--prefill", "http://p", "--decode", "http://d", "--http-body-timeout", "-1"])
    assert rc == 2 and "--http-body-timeout must be a positive" in capsys.readouterr().err

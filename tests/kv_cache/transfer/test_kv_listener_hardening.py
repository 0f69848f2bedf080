"""The KV producer's listener against peers that are not consumers (issue 29, point 4).

Junk connections (silent, garbage, half a frame) must not starve a real P/D transfer; a peer that
has not proven the shared secret learns nothing about the model; the handshake has a total
deadline; connections are capped per remote address and in all; idle authenticated connections
close; and a flood of junk is a few log lines, not one per connection.

Deadlines here are small so the tests are fast, and every time bound is loose (a slow 2-core CI
machine must not fail them): the lower bounds only show a close came from the deadline and not
from something else, the upper bounds are many times the deadline.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import struct
import time

import numpy as np
import pytest
from kv_producer_child import random_pages  # tests/kv_cache/transfer/kv_producer_child.py
from polling import wait_until  # tests/polling.py

from tpuserve.kv_cache.transfer import auth
from tpuserve.kv_cache.transfer.errors import KVTransferError
from tpuserve.kv_cache.transfer.framing import MAGIC, VERSION, Deadline, recv_frame, send_frame
from tpuserve.kv_cache.transfer.layout import KVLayout
from tpuserve.kv_cache.transfer.tcp import TcpKVReceiver, TcpKVSender

pytestmark = pytest.mark.timeout(60)

SECRET = "listener-hardening-test-secret"
LOGGER = "tpuserve.kv_cache.transfer.tcp"
PREFIX = struct.Struct(">4sB3xIQ")  # framing's frame prefix, spelled out: the tests speak the wire


def _layout(**kw) -> KVLayout:
    base = dict(model_id="tiny", num_layers=3, page_size=4, combined_heads=4, head_dim=8, dtype="float32")
    return KVLayout(**{**base, **kw})


def _connect(address, source: str | None = None) -> socket.socket:
    return socket.create_connection(address, timeout=10, source_address=(source, 0) if source else None)


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the listener closed ``sock`` (what it sends meanwhile is read and dropped),
    or None if still open after ``seconds``."""
    t0 = time.monotonic()
    while (left := t0 + seconds - time.monotonic()) > 0:
        if not select.select([sock], [], [], left)[0]:
            break
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except OSError:  # reset: closed with our bytes unread
            return time.monotonic() - t0
    return None


def _frames(data: bytes) -> list[dict]:
    """The headers of the whole frames in ``data``; asserts nothing else is there."""
    out = []
    while data:
        magic, version, head_len, payload_len = PREFIX.unpack_from(data)
        assert (magic, version) == (MAGIC, VERSION)
        end = PREFIX.size + head_len + payload_len
        assert len(data) >= end, "a partial frame"
        out.append(json.loads(data[PREFIX.size : PREFIX.size + head_len]))
        data = data[end:]
    return out


def _read_for(sock: socket.socket, seconds: float) -> bytes:
    """Everything the peer sends within ``seconds`` (or until it closes)."""
    got, t_end = b"", time.monotonic() + seconds
    while (left := t_end - time.monotonic()) > 0 and select.select([sock], [], [], left)[0]:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    return got


def _authenticate(sock: socket.socket, secret: str = SECRET) -> dict:
    """The consumer's side of the handshake by hand; returns the producer's 'ok' header."""
    d = Deadline.after(10, 10)
    hello, _ = recv_frame(sock, d)
    nonce_p, nonce_c = bytes.fromhex(hello["nonce"]), auth.new_nonce()
    send_frame(
        sock,
        {
            "type": "auth",
            "nonce": nonce_c.hex(),
            "proof": auth.proof(secret.encode(), auth.CLIENT_LABEL, nonce_p, nonce_c).hex(),
        },
        deadline=d,
    )
    ok, _ = recv_frame(sock, d)
    assert ok["type"] == "ok", ok
    send_frame(sock, {"type": "layout", "layout_digest": ok["layout_digest"]}, deadline=d)
    return ok


def _junk(address, i: int, source: str | None = None) -> socket.socket:
    """A connection that never authenticates: silent, HTTP garbage, or a frame cut short."""
    j = _connect(address, source)
    try:
        if i % 3 == 1:
            j.sendall(b"GET / HTTP/1.1\r\nHost: kv\r\n\r\n")
        elif i % 3 == 2:
            j.sendall(PREFIX.pack(MAGIC, VERSION, 200, 0) + b'{"type": "auth", "no')  # 180 bytes owed
    except OSError:
        pass  # already displaced or dropped: junk either way
    return j


def _tcp_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


# ---- (a) junk does not starve a real transfer ----


@pytest.mark.timeout(120)
def test_200_junk_connections_do_not_starve_real_pd_transfers(monkeypatch, caplog):
    """The engine's own P/D path (``KVTransferRole``: gather + offer, pull, scatter) with the
    listener's default connection limits, while 200 junk connections from the consumer's own
    address sit open (or try to)."""
    import jax.numpy as jnp

    from tpuserve.server.kv_transfer import KVTransferRole
    from tpuserve.tpu_platform.config import KVTransferConfig

    monkeypatch.setenv("TPUSERVE_KV_SECRET", SECRET)
    monkeypatch.delenv("TPUSERVE_KV_SECRET_FILE", raising=False)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    shape = (2, 16, 4, 4, 8)
    src = jnp.asarray(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    dst = jnp.zeros(shape, jnp.float32)
    # The junk must still be held while the transfers run: a long handshake deadline.
    producer = KVTransferRole(
        KVTransferConfig(
            kv_role="kv_producer", kv_port=0, kv_connector_extra_config={"handshake_timeout_s": 60}
        ),
        "tiny",
        src,
    )
    consumer = KVTransferRole(KVTransferConfig(kv_role="kv_consumer"), "tiny", dst)
    junk: list[socket.socket] = []
    try:
        sender = producer.sender
        assert sender.handshake_timeout_s == 60.0  # from kv_connector_extra_config; the limits default
        params = [producer.export(f"req-{i}", src, [1 + i, 5 + i, 9 + i], 11) for i in range(3)]
        for i in range(200):
            junk.append(_junk(sender.address, i))
        t0 = time.monotonic()
        for i, p in enumerate(params):
            batch = consumer.pull(p, timeout_s=30)
            dest = [2 + i, 6 + i, 10 + i]
            dst = consumer.import_pages(dst, batch.pages, dest)
            assert np.asarray(dst)[:, dest].tobytes() == np.asarray(src)[:, [1 + i, 5 + i, 9 + i]].tobytes()
        elapsed = time.monotonic() - t0
        assert elapsed < 20, f"3 transfers took {elapsed:.1f}s next to the junk"
        # The junk was held, not timed out: the transfers did not just outwait it.
        assert 10 <= sender.connection_counts().get("127.0.0.1", (0, 0))[0] <= 16
        assert {e.reason for e in sender.drain_finished()} == {"pulled"}
    finally:
        for j in junk:
            j.close()
        producer.close()
    # 200 junk connections: a few lines (displaced, not the protocol), not one per connection.
    lines = [r.getMessage() for r in _tcp_records(caplog)]
    assert len(lines) <= 6, lines
    assert any("displaced" in m or "oldest unauthenticated" in m for m in lines), lines


def test_a_junk_flood_from_another_address_leaves_the_consumer_alone():
    """Junk from 127.0.0.2 only ever displaces its own connections."""
    layout = _layout()
    with TcpKVSender(layout, secret=SECRET, handshake_timeout_s=60, max_connections=24) as s:
        handles = [s.offer(f"r{i}", random_pages(layout, 2, i), num_tokens=8) for i in range(2)]
        try:
            junk = [_junk(s.address, i, source="127.0.0.2") for i in range(100)]
        except OSError as e:
            pytest.skip(f"no second loopback address here: {e}")
        try:
            with _connect(s.address) as held:  # a consumer connection held open meanwhile
                _authenticate(held)
                wait_until(lambda: s.connection_counts().get("127.0.0.2", (0, 0))[0] <= 16)
                for i, h in enumerate(handles):
                    got = TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=30)
                    assert got.pages.tobytes() == random_pages(layout, 2, i).tobytes()
                wait_until(lambda: s.connection_counts()["127.0.0.1"] == (1, 1))  # the pulls' ended
                assert _closed_within(held, 0.2) is None
        finally:
            for j in junk:
                j.close()


# ---- (b) no model details before authentication ----


def test_an_unauthenticated_peer_learns_nothing_about_the_model():
    layout = _layout(model_id="org/very-secret-model-7b", num_layers=5, head_dim=16)
    telltales = [
        b"very-secret-model",
        layout.digest().encode(),
        b"layout",
        b"page_size",
        b"head_dim",
        b"num_layers",
        b"float32",
        b"model",
    ]
    with TcpKVSender(layout, secret=SECRET, handshake_timeout_s=30) as s:
        s.offer("req-1", random_pages(layout, 1, 0), num_tokens=4)

        # What the listener says unprompted: a nonce and nothing else.
        with _connect(s.address) as c:
            before = _read_for(c, 1.0)
            [hello] = _frames(before)
            assert set(hello) == {"type", "nonce"} and hello["type"] == "hello"
            assert len(bytes.fromhex(hello["nonce"])) == auth.NONCE_BYTES
            assert not [t for t in telltales if t in before]
            # A wrong proof: refused, still nothing about the model, then closed.
            nonce_c = auth.new_nonce()
            wrong = auth.proof(
                b"not-the-secret-at-all", auth.CLIENT_LABEL, bytes.fromhex(hello["nonce"]), nonce_c
            )
            send_frame(c, {"type": "auth", "nonce": nonce_c.hex(), "proof": wrong.hex()})
            after = _read_for(c, 5.0)
            assert [f["code"] for f in _frames(after)] == ["auth_failed"]
            assert not [t for t in telltales if t in after]
            assert _closed_within(c, 5.0) is not None

        # A peer that skips authentication and asks for pages gets nothing either.
        with _connect(s.address) as c:
            recv_frame(c, Deadline.after(5, 5))
            send_frame(c, {"type": "pull", "transfer_id": "0" * 32})
            rest = _read_for(c, 5.0)
            assert not [t for t in telltales if t in rest] and b"pages" not in rest

        # The same bytes arrive once the secret is proven (so the checks above could fail).
        with _connect(s.address) as c:
            ok = _authenticate(c)
            assert ok["layout"] == layout.to_dict() and ok["layout_digest"] == layout.digest()


# ---- (c) the handshake deadline ----


@pytest.mark.parametrize("stall", ["silent", "half-frame", "trickle"])
def test_a_connection_stalled_in_the_handshake_is_closed_after_the_deadline(stall, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    layout = _layout()
    with TcpKVSender(layout, secret=SECRET, handshake_timeout_s=0.5) as s:
        h = s.offer("r", random_pages(layout, 1, 0), num_tokens=4)
        with _connect(s.address) as c:
            t0 = time.monotonic()
            if stall == "half-frame":
                c.sendall(PREFIX.pack(MAGIC, VERSION, 100, 0) + b'{"type": "auth"')
            if stall == "trickle":
                # One byte of a long frame every 50 ms: each read makes progress, so only a deadline
                # on the whole handshake (not on each read) ends it.
                frame = PREFIX.pack(MAGIC, VERSION, 4000, 0) + b" " * 4000
                closed = None
                for b in frame:
                    if _closed_within(c, 0.05) is not None:
                        closed = time.monotonic() - t0
                        break
                    try:
                        c.send(bytes([b]))
                    except OSError:
                        closed = time.monotonic() - t0
                        break
                    if time.monotonic() - t0 > 15:
                        break
            else:
                closed = _closed_within(c, 15)
            assert closed is not None, "the stalled handshake was never closed"
            assert 0.4 <= closed < 10, closed
        wait_until(lambda: s.connection_counts() == {})
        assert TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=10).request_id == "r"
    lines = [r.getMessage() for r in _tcp_records(caplog)]
    assert [m for m in lines if "did not authenticate within 0.5s" in m], lines


def test_the_default_handshake_deadline_is_short():
    with TcpKVSender(_layout(), secret=SECRET) as s:
        assert 0 < s.handshake_timeout_s <= 10
        assert 0 < s.idle_timeout_s <= 120


# ---- (d) connection limits ----


def test_the_per_peer_limit_closes_excess_connections(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    layout = _layout()
    with TcpKVSender(
        layout, secret=SECRET, handshake_timeout_s=60, idle_timeout_s=60, max_connections_per_peer=4
    ) as s:
        h = s.offer("r", random_pages(layout, 1, 0), num_tokens=4)
        first = [_connect(s.address) for _ in range(4)]
        wait_until(lambda: s.connection_counts() == {"127.0.0.1": (4, 0)})
        assert all(_closed_within(c, 0.2) is None for c in first)

        # Three more handshakes: the three oldest unauthenticated connections are closed at once.
        extra = [_connect(s.address) for _ in range(3)]
        assert all(_closed_within(c, 5.0) is not None for c in first[:3])
        assert all(_closed_within(c, 0.3) is None for c in first[3:] + extra)
        assert s.connection_counts() == {"127.0.0.1": (4, 0)}

        # Four authenticated connections fill the peer's quota (displacing the rest) ...
        consumers = [_connect(s.address) for _ in range(4)]
        for c in consumers:
            _authenticate(c)
        wait_until(lambda: s.connection_counts() == {"127.0.0.1": (4, 4)})
        assert all(_closed_within(c, 5.0) is not None for c in first[3:] + extra)
        # ... so further connections from this address are refused at once, with a reason.
        for _ in range(5):
            with _connect(s.address) as c:
                t0 = time.monotonic()
                frames = _frames(_read_for(c, 5.0))
                assert time.monotonic() - t0 < 5
                assert [f.get("code") for f in frames] == ["busy"]
        with pytest.raises(KVTransferError, match=r"too many connections.*\[busy\]"):
            TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=10)

        # One authenticated connection ends: a pull from the same address goes through again.
        consumers.pop().close()
        wait_until(lambda: s.connection_counts() == {"127.0.0.1": (3, 3)})
        assert TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=10).request_id == "r"
        for c in first + extra + consumers:
            c.close()
    lines = [r.getMessage() for r in _tcp_records(caplog)]
    refused = [m for m in lines if "refused a connection from 127.0.0.1" in m]
    assert len(refused) == 1, lines  # six refusals, one line


def test_the_global_cap_displaces_the_busiest_peers_oldest_handshake():
    layout = _layout()
    with TcpKVSender(
        layout, secret=SECRET, handshake_timeout_s=60, max_connections=6, max_connections_per_peer=4
    ) as s:
        try:
            a = [_connect(s.address, "127.0.0.2") for _ in range(4)]
            b = [_connect(s.address, "127.0.0.3") for _ in range(2)]
        except OSError as e:
            pytest.skip(f"no extra loopback addresses here: {e}")
        wait_until(lambda: s.connection_counts() == {"127.0.0.2": (4, 0), "127.0.0.3": (2, 0)})
        # Full: a newcomer from a third address displaces 127.0.0.2's oldest, not 127.0.0.3's.
        with _connect(s.address) as c:
            assert _closed_within(a[0], 5.0) is not None
            _authenticate(c)
            assert all(_closed_within(x, 0.2) is None for x in a[1:] + b)
            wait_until(
                lambda: (
                    s.connection_counts() == {"127.0.0.1": (1, 1), "127.0.0.2": (3, 0), "127.0.0.3": (2, 0)}
                )
            )
        for x in a + b:
            x.close()


# ---- (e) the idle timeout ----


def test_idle_authenticated_connections_are_closed(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    layout = _layout()
    with TcpKVSender(layout, secret=SECRET, idle_timeout_s=1.0, handshake_timeout_s=30) as s:
        h = s.offer("r", random_pages(layout, 1, 0), num_tokens=4)
        with _connect(s.address) as busy:
            # A connection in use is not cut: requests 0.2 s apart for 2 s (twice the idle timeout).
            _authenticate(busy)
            for i in range(10):
                if i:
                    time.sleep(0.2)
                send_frame(busy, {"type": "release", "transfer_id": "0" * 32})
                done, _ = recv_frame(busy, Deadline.after(10, 10))
                assert done == {"type": "done", "released": False}
            # Then quiet: closed after the idle timeout.
            closed = _closed_within(busy, 15)
            assert closed is not None, "the idle connection was never closed"
            assert 0.5 <= closed < 10, closed
        wait_until(lambda: s.connection_counts() == {})
        assert TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=10).request_id == "r"
    assert [r for r in _tcp_records(caplog) if "idle connection" in r.getMessage()]


# ---- robustness and configuration ----


def test_the_listener_survives_a_mess_of_peers_and_keeps_serving():
    """Resets, half-closes and oversized headers, from several connections at once."""
    layout = _layout()
    with TcpKVSender(layout, secret=SECRET, handshake_timeout_s=1.0) as s:
        h = s.offer("r", random_pages(layout, 2, 1), num_tokens=8)
        socks = []
        for i in range(30):
            c = _connect(s.address)
            if i % 3 == 0:  # an RST right away
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()
                continue
            if i % 3 == 1:
                c.sendall(PREFIX.pack(MAGIC, VERSION, 1 << 30, 0))  # a header far over the limit
            else:
                c.shutdown(socket.SHUT_WR)
            socks.append(c)
        got = TcpKVReceiver(layout, secret=SECRET).pull(h, timeout_s=10)
        assert got.pages.tobytes() == random_pages(layout, 2, 1).tobytes()
        for c in socks:
            assert _closed_within(c, 10) is not None
            c.close()
        wait_until(lambda: s.connection_counts() == {})
        assert s._threads[0].is_alive()  # the accept loop


def test_sender_rejects_nonsense_limits():
    for kw in (
        {"handshake_timeout_s": 0},
        {"idle_timeout_s": -1},
        {"max_connections": 0},
        {"max_connections_per_peer": 0},
        {"handshake_timeout_s": float("nan")},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            TcpKVSender(_layout(), secret=SECRET, **kw)


def test_listener_options_from_kv_connector_extra_config():
    from tpuserve.server.kv_transfer import listener_options

    assert listener_options(None) == {} and listener_options({"pull_timeout_s": 3}) == {}
    got = listener_options(
        {
            "handshake_timeout_s": 2,
            "idle_timeout_s": 7.5,
            "max_connections": 32,
            "max_connections_per_peer": 8.0,
        }
    )
    assert got == {
        "handshake_timeout_s": 2.0,
        "idle_timeout_s": 7.5,
        "max_connections": 32,
        "max_connections_per_peer": 8,
    }
    assert all(type(v) is (float if k.endswith("_s") else int) for k, v in got.items())
    for bad in (
        {"max_connections": 2.5},
        {"handshake_timeout_s": "3"},
        {"idle_timeout_s": 0},
        {"max_connections_per_peer": True},
    ):
        with pytest.raises(ValueError, match=f"extra_config.{next(iter(bad))}"):
            listener_options(bad)

"""The framed-TCP KV transport: ``TcpKVSender`` (producer, a listener) and ``TcpKVReceiver``.

One connection per pull. The exchange (frames from ``framing``; C = consumer, P = producer)::

    P -> C  hello    {nonce_p}                     (nothing else: the peer has proven nothing yet)
    C -> P  auth     {nonce_c, proof_c = HMAC(secret, CLIENT_LABEL, nonce_p, nonce_c)}
    P -> C  ok       {proof_p = HMAC(secret, SERVER_LABEL, nonce_c, nonce_p, digest_p),
                      layout, layout_digest = digest_p}
            | error  {code: auth_failed, message}
    C -> P  layout   {layout_digest}               (C checked proof_p and the layouts first)
    C -> P  pull     {transfer_id}                        | release {transfer_id}
    P -> C  pages    {request_id, num_tokens, meta, shape, dtype} + raw bytes [L, n, ps, C, D] (C order)
            | error  {code: not_found | busy | layout_mismatch | internal, message}
    C -> P  ack      {transfer_id}          (the lease ends as "pulled" only now)
    P -> C  done     {}

Authentication comes first: until a peer has proven the secret the listener tells it nothing about
the model (the layout names it); it gets a nonce, then ``auth_failed`` or a close. Both sides prove
the secret (the consumer must not accept pages from an impostor either). The producer's proof
covers its layout digest, so the layout the consumer compares, and names the differing fields of,
is the producer's own. The consumer sends ``layout`` and its first request back to back (no extra
round trip); a producer that disagrees answers with ``layout_mismatch`` and closes.

The listener expects peers that are not consumers (port scanners, stray clients, junk). Every
connection gets its own thread and a deadline on every read, so the accept loop never waits on a
peer. The handshake must finish within ``handshake_timeout_s`` in total (trickling bytes does not
extend it); an authenticated connection closes after ``idle_timeout_s`` without a request. At most
``max_connections_per_peer`` connections per remote address and ``max_connections`` in all are
held: a connection past a cap displaces the oldest one still in its handshake (of its own address,
or else of the address holding the most), so junk that connects and waits cannot lock a consumer
out, even one on the same host; only when every held connection is authenticated is the newcomer
refused, at once, with a ``busy`` error. Refusals and failed handshakes are logged once per peer
and kind of event per minute, with a count of the rest, not once per connection.

The page bytes themselves are not MAC'd: the listener binds 127.0.0.1 unless told otherwise, and a
network between hosts should be trusted or tunnelled. A failed or unacknowledged send leaves the
lease in place (the consumer may retry) until it expires.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from tpuserve.kv_cache.transfer import auth
from tpuserve.kv_cache.transfer.errors import (
    AuthError,
    KVTransferError,
    LayoutMismatchError,
    PeerClosedError,
    ProtocolError,
    TransferNotFoundError,
    TransferTimeoutError,
)
from tpuserve.kv_cache.transfer.framing import Deadline, recv_frame, recv_header, recv_into, send_frame
from tpuserve.kv_cache.transfer.layout import KVLayout, dtype_from_name
from tpuserve.kv_cache.transfer.lease import Lease, LeaseTable
from tpuserve.kv_cache.transfer.transport import (
    KVReceiver,
    KVSender,
    LeaseEvent,
    PageBatch,
    PendingPages,
    TransferHandle,
    as_pages_array,
)

log = logging.getLogger(__name__)

_ERRORS: dict[str, type[KVTransferError]] = {
    "auth_failed": AuthError,
    "layout_mismatch": LayoutMismatchError,
    "not_found": TransferNotFoundError,
}

# A burst of connections waits in the kernel's queue instead of having SYNs dropped: a dropped SYN
# costs the consumer caught in the burst a one-second retransmit.
_BACKLOG = 1024
# Per peer and kind of event, the listener logs at most one line per this many seconds ...
_REPORT_INTERVAL_S = 60.0
# ... and at most this many lines per interval in all (peers may use many addresses).
_REPORT_BUDGET = 64


def _as_bytes_view(a: np.ndarray) -> memoryview:
    """A flat byte view of ``a`` (copied only if not C-contiguous); works for ml_dtypes too."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def _hex(header: dict, key: str, nbytes: int | None = None) -> bytes:
    v = header.get(key)
    try:
        if not isinstance(v, str):
            raise TypeError(key)
        b = bytes.fromhex(v)
    except (TypeError, ValueError):
        raise ProtocolError(f"{header.get('type')!r} frame: {key} is not hex") from None
    if nbytes is not None and len(b) != nbytes:
        raise ProtocolError(f"{header.get('type')!r} frame: {key} must be {nbytes} bytes")
    return b


def _raise_error_frame(header: dict, where: str) -> None:
    if header.get("type") == "error":
        code, msg = header.get("code"), header.get("message", "")
        raise _ERRORS.get(code if isinstance(code, str) else "", KVTransferError)(
            f"KV producer at {where}: {msg} [{code}]"
        )


def _positive(name: str, value: float) -> None:
    if not 0 < value < float("inf"):  # NaN fails too
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _shutdown(sock: socket.socket) -> None:
    """Wake whatever thread waits on ``sock`` (a close from another thread would not) and FIN it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already reset or closed by the peer


@dataclass(eq=False)
class _Conn:
    """One accepted connection, as the limits see it."""

    sock: socket.socket
    peer: str  # the remote IP address: the unit of the per-peer limit
    authenticated: bool = False
    displaced: bool = False  # closed for a newer connection (and logged then)


class _ConnectionTable:
    """Live connections by remote address under a per-peer and a global cap (thread-safe).

    Past a cap the oldest connection still in its handshake gives way to the new one: a real
    consumer finishes its handshake in milliseconds, so what gives way is almost always a peer that
    connected and then waited. Authenticated connections are never displaced.
    """

    def __init__(self, max_total: int, max_per_peer: int):
        self.max_total, self.max_per_peer = max_total, max_per_peer
        self._lock = threading.Lock()
        self._by_peer: dict[str, list[_Conn]] = {}  # each list in arrival order
        self._total = 0

    def admit(self, c: _Conn) -> tuple[str, _Conn | None]:
        """("admitted" | "peer_full" | "full", the connection displaced for ``c``, shut down)."""
        with self._lock:
            victim = None
            mine = self._by_peer.get(c.peer, [])
            if len(mine) >= self.max_per_peer:
                victim = next((x for x in mine if not x.authenticated), None)
                if victim is None:
                    return "peer_full", None
            elif self._total >= self.max_total:
                victim = self._oldest_pending_of_busiest()
                if victim is None:
                    return "full", None
            if victim is not None:
                self._drop(victim)
                victim.displaced = True
                _shutdown(victim.sock)  # under the lock: its thread closes it only once dropped
            self._by_peer.setdefault(c.peer, []).append(c)
            self._total += 1
            return "admitted", victim

    def _oldest_pending_of_busiest(self) -> _Conn | None:
        best: list[_Conn] = []
        for conns in self._by_peer.values():
            pending = [x for x in conns if not x.authenticated]
            if len(pending) > len(best):
                best = pending
        return best[0] if best else None

    def mark_authenticated(self, c: _Conn) -> bool:
        """False if ``c`` was displaced before it proved the secret."""
        with self._lock:
            if c.displaced:
                return False
            c.authenticated = True
            return True

    def remove(self, c: _Conn) -> None:
        with self._lock:
            if not c.displaced:
                self._drop(c)

    def _drop(self, c: _Conn) -> None:
        conns = self._by_peer.get(c.peer, [])
        if c in conns:
            conns.remove(c)
            self._total -= 1
            if not conns:
                del self._by_peer[c.peer]

    def counts(self) -> dict[str, tuple[int, int]]:
        """{peer: (connections, of which authenticated)}."""
        with self._lock:
            return {p: (len(cs), sum(x.authenticated for x in cs)) for p, cs in self._by_peer.items()}

    def shutdown_all(self) -> None:
        with self._lock:
            for conns in self._by_peer.values():
                for c in conns:
                    _shutdown(c.sock)


class _PeerEventLog:
    """Logs each kind of listener event at most once per peer per ``interval_s``, and at most
    ``budget`` lines per interval in all; the lines held back are counted into the next one.

    200 junk connections then make a line or two, not 200, while a new peer or a new kind of
    trouble still shows at once.
    """

    def __init__(self, interval_s: float = _REPORT_INTERVAL_S, budget: int = _REPORT_BUDGET):
        self.interval_s, self.budget = interval_s, budget
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # -> (logged at, held back since)
        self._window_at, self._window_lines, self._window_dropped = float("-inf"), 0, 0

    def __call__(self, level: int, peer: str, kind: str, msg: str, *args, exc_info=None) -> None:
        if not log.isEnabledFor(level):
            return
        now = time.monotonic()
        with self._lock:
            rolled = self._roll(now) if now - self._window_at >= self.interval_s else 0
            logged_at, held = self._last.get((peer, kind), (float("-inf"), 0))
            if now - logged_at < self.interval_s:
                self._last[(peer, kind)] = (logged_at, held + 1)
                line = False
            elif self._window_lines >= self.budget:
                self._window_dropped += 1
                line = False
            else:
                self._window_lines += 1
                self._last[(peer, kind)] = (now, 0)
                line = True
        if rolled:
            log.info(
                "KV listener: %d more connection events in the last %.0fs were not logged one by one",
                rolled,
                self.interval_s,
            )
        if line:
            if held:
                msg += " (%d more like it in the last %.0fs)"
                args = (*args, held, now - logged_at)
            log.log(level, msg, *args, exc_info=exc_info)

    def _roll(self, now: float) -> int:
        """Start a new interval; forget peers quiet for one (so the table stays small) and return
        how many events were held back and will not be counted into a later line."""
        stale = {k: v for k, v in self._last.items() if now - v[0] >= self.interval_s}
        held = sum(h for _, h in stale.values()) + self._window_dropped
        for k in stale:
            del self._last[k]
        self._window_at, self._window_lines, self._window_dropped = now, 0, 0
        return held


class TcpKVSender(KVSender):
    """The producer's listener: pages offered here are pulled over framed TCP.

    ``host`` is the bind address (loopback unless told otherwise); ``advertise_host`` is what
    handles name (default: ``host``). ``port=0`` picks a free port (see ``address``). The
    connection limits and deadlines (``handshake_timeout_s``, ``idle_timeout_s``,
    ``max_connections``, ``max_connections_per_peer``) are described in the module docstring.
    """

    def __init__(
        self,
        layout: KVLayout,
        secret: bytes | str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        default_ttl_s: float = 120.0,
        io_timeout_s: float = 30.0,
        handshake_timeout_s: float = 5.0,
        max_held_bytes: int | None = None,
        max_connections: int = 64,
        *,
        max_connections_per_peer: int = 16,
        idle_timeout_s: float = 30.0,
    ):
        for name, v in (
            ("io_timeout_s", io_timeout_s),
            ("handshake_timeout_s", handshake_timeout_s),
            ("idle_timeout_s", idle_timeout_s),
            ("max_connections", max_connections),
            ("max_connections_per_peer", max_connections_per_peer),
        ):
            _positive(name, v)
        self.layout = layout
        self._digest = layout.digest()
        self._secret = auth.load_secret(secret)
        self.default_ttl_s = float(default_ttl_s)
        self.io_timeout_s = float(io_timeout_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self.leases = LeaseTable(max_held_bytes)
        self._conns = _ConnectionTable(int(max_connections), int(max_connections_per_peer))
        self._report = _PeerEventLog()
        self._closed = threading.Event()
        self._listener = socket.create_server((host, port), backlog=_BACKLOG)
        self._listener.settimeout(0.5)  # the accept loop checks for close at least this often
        bound = self._listener.getsockname()
        self.host, self.port = advertise_host or host, int(bound[1])
        self._threads = [
            threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True),
            threading.Thread(target=self._reap_loop, name="kv-lease-reaper", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def connection_counts(self) -> dict[str, tuple[int, int]]:
        """Held connections by remote address: ``{ip: (connections, of which authenticated)}``."""
        return self._conns.counts()

    # ---- the engine's API ----

    def offer(
        self, request_id: str, pages, num_tokens: int, meta: dict | None = None, ttl_s: float | None = None
    ) -> TransferHandle:
        if self._closed.is_set():
            raise KVTransferError("the KV sender is closed")
        if isinstance(pages, np.ndarray):
            as_pages_array(pages, self.layout)  # fail now, not at pull time
            n = pages.shape[1]
        elif isinstance(pages, PendingPages):
            n = int(pages.num_pages)
        else:
            raise TypeError(f"pages must be a numpy array or PendingPages, got {type(pages).__name__}")
        tid = uuid.uuid4().hex  # 122 random bits
        ttl = self.default_ttl_s if ttl_s is None else float(ttl_s)
        self.leases.add(
            Lease(
                tid,
                str(request_id),
                pages,
                n,
                int(num_tokens),
                dict(meta or {}),
                self.layout.pages_nbytes(n),
                time.monotonic() + ttl,
            )
        )
        return TransferHandle(tid, str(request_id), self.host, self.port, n, int(num_tokens), self._digest)

    def release(self, transfer_id: str) -> bool:
        return self.leases.end(transfer_id, "released")

    def drain_finished(self) -> list[LeaseEvent]:
        self.leases.expire()
        return self.leases.drain_events()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.leases.clear()
        _shutdown(self._listener)  # wakes a blocked accept now rather than at its next timeout
        self._listener.close()
        self._conns.shutdown_all()  # connection threads see EOF and exit
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> TcpKVSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- threads ----

    def _reap_loop(self) -> None:
        cond = self.leases.changed
        while not self._closed.is_set():
            self.leases.expire()
            wait = self.leases.seconds_to_next_expiry()
            with cond:
                cond.wait(timeout=0.5 if wait is None else min(max(wait, 0.005), 0.5))

    def _accept_loop(self) -> None:
        """Accept, apply the limits, hand off: nothing here waits on a peer."""
        while not self._closed.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed.is_set():
                    return
                # Out of descriptors or buffers: keep listening, without spinning on the error.
                self._report(logging.WARNING, "*", "accept", "KV listener: accept failed: %s", e)
                time.sleep(0.1)
                continue
            try:
                self._admit(sock, str(addr[0]))
            except Exception:  # a bug here must not stop the listener
                self._report(
                    logging.ERROR,
                    str(addr[0]),
                    "admit",
                    "KV listener: admitting a connection from %s failed",
                    addr[0],
                    exc_info=True,
                )

    def _admit(self, sock: socket.socket, peer: str) -> None:
        c = _Conn(sock, peer)
        verdict, victim = self._conns.admit(c)
        if victim is not None:
            self._report(
                logging.INFO,
                victim.peer,
                "displaced",
                "KV listener: closed the oldest unauthenticated connection from %s to admit a "
                "newer one (limits: %d connections per peer, %d in all)",
                victim.peer,
                self._conns.max_per_peer,
                self._conns.max_total,
            )
        if verdict != "admitted":
            self._refuse(c, verdict)
            return
        try:
            threading.Thread(target=self._serve, args=(c,), name="kv-tcp-conn", daemon=True).start()
        except Exception as e:  # no thread to be had: shed this connection, keep listening
            self._conns.remove(c)
            sock.close()
            self._report(
                logging.ERROR,
                peer,
                "thread",
                "KV listener: dropped a connection from %s: cannot start a thread for it (%s)",
                peer,
                e,
            )

    def _refuse(self, c: _Conn, verdict: str) -> None:
        if verdict == "peer_full":
            why = f"its {self._conns.max_per_peer} connections (max_connections_per_peer) are all busy"
        else:
            why = f"all {self._conns.max_total} connections (max_connections) are busy"
        try:
            c.sock.settimeout(0)  # never wait on this peer: the frame fits a fresh socket or is lost
            send_frame(
                c.sock,
                {
                    "type": "error",
                    "code": "busy",
                    "message": "too many connections to this KV producer; retry later",
                },
            )
        except (OSError, KVTransferError):
            pass
        c.sock.close()
        self._report(
            logging.WARNING,
            c.peer,
            verdict,
            "KV listener: refused a connection from %s: %s with authenticated transfers",
            c.peer,
            why,
        )

    def _serve(self, c: _Conn) -> None:
        authenticated = False
        try:
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._handshake(c)
            authenticated = True
            self._requests(c.sock, c.peer)
        except Exception as e:  # a peer's failure or a bug: this connection ends, the listener stays
            self._connection_failed(c, authenticated, e)
        finally:
            self._conns.remove(c)
            c.sock.close()

    def _connection_failed(self, c: _Conn, authenticated: bool, e: Exception) -> None:
        """Log why a connection ended, once per peer and kind (see ``_PeerEventLog``)."""
        if c.displaced or self._closed.is_set():
            return  # logged when displaced; or the sender is closing
        peer, r = c.peer, self._report
        if isinstance(e, AuthError):
            r(
                logging.WARNING,
                peer,
                "auth",
                "KV listener: a peer at %s failed authentication (is %s the same on both engines?)",
                peer,
                auth.SECRET_ENV,
            )
        elif isinstance(e, LayoutMismatchError):
            r(
                logging.WARNING,
                peer,
                "layout",
                "KV listener: the consumer at %s has another KV layout: %s",
                peer,
                e,
            )
        elif not authenticated and isinstance(e, TransferTimeoutError):
            r(
                logging.INFO,
                peer,
                "handshake_timeout",
                "KV listener: closed a connection from %s that did not authenticate within %gs",
                peer,
                self.handshake_timeout_s,
            )
        elif not authenticated and isinstance(e, ProtocolError):
            r(
                logging.INFO,
                peer,
                "protocol",
                "KV listener: closed a connection from %s that does not speak the KV transfer protocol: %s",
                peer,
                e,
            )
        elif not authenticated and isinstance(e, (PeerClosedError, OSError)):
            r(logging.DEBUG, peer, "gone", "KV listener: %s went away during the handshake: %s", peer, e)
        elif isinstance(e, (KVTransferError, OSError)):
            r(logging.INFO, peer, "transfer", "KV sender: connection from %s ended: %s", peer, e)
        else:
            r(logging.ERROR, peer, "bug", "KV sender: connection from %s failed", peer, exc_info=e)

    def _handshake(self, c: _Conn) -> None:
        """Authenticate the peer; only then show it the layout, and check its own."""
        conn = c.sock
        d = Deadline.after(self.handshake_timeout_s, self.handshake_timeout_s)  # total, not per read
        nonce_p = auth.new_nonce()
        send_frame(conn, {"type": "hello", "nonce": nonce_p.hex()}, deadline=d)
        h, _ = recv_frame(conn, d)
        if h["type"] != "auth":
            raise ProtocolError(f"expected an 'auth' frame, got {h['type']!r}")
        nonce_c, got = _hex(h, "nonce", auth.NONCE_BYTES), _hex(h, "proof", 32)
        if not auth.check_proof(auth.proof(self._secret, auth.CLIENT_LABEL, nonce_p, nonce_c), got):
            send_frame(
                conn,
                {
                    "type": "error",
                    "code": "auth_failed",
                    "message": "authentication failed: the consumer's shared secret differs",
                },
                deadline=d,
            )
            raise AuthError("a consumer failed authentication")
        if not self._conns.mark_authenticated(c):
            raise PeerClosedError("the connection was displaced during its handshake")
        send_frame(
            conn,
            {
                "type": "ok",
                "layout": self.layout.to_dict(),
                "layout_digest": self._digest,
                "proof": auth.proof(
                    self._secret, auth.SERVER_LABEL, nonce_c, nonce_p, self._digest.encode()
                ).hex(),
            },
            deadline=d,
        )
        h, _ = recv_frame(conn, d)
        if h["type"] != "layout":
            raise ProtocolError(f"expected a 'layout' frame, got {h['type']!r}")
        digest_c = str(h.get("layout_digest", ""))
        if digest_c != self._digest:
            send_frame(
                conn,
                {
                    "type": "error",
                    "code": "layout_mismatch",
                    "message": f"KV layout digest {digest_c} differs from the producer's "
                    f"{self._digest} ({self.layout})",
                },
                deadline=d,
            )
            raise LayoutMismatchError(f"its layout digest {digest_c} differs from ours ({self._digest})")

    def _requests(self, conn: socket.socket, peer: str) -> None:
        while not self._closed.is_set():
            try:
                # Between requests a connection is idle: bounded, so a quiet peer frees its slot.
                h, _ = recv_frame(
                    conn, Deadline.after(self.idle_timeout_s, min(self.io_timeout_s, self.idle_timeout_s))
                )
            except PeerClosedError:
                return  # the consumer is done
            except TransferTimeoutError:
                self._report(
                    logging.DEBUG,
                    peer,
                    "idle",
                    "KV listener: closed an idle connection from %s (no request for %gs)",
                    peer,
                    self.idle_timeout_s,
                )
                return
            tid = str(h.get("transfer_id", ""))
            if h["type"] == "pull":
                self._send_pages(conn, tid)
            elif h["type"] == "release":
                ended = self.leases.end(tid, "released")
                send_frame(
                    conn,
                    {"type": "done", "released": ended},
                    deadline=Deadline.after(self.io_timeout_s, self.io_timeout_s),
                )
            elif not self._handle_other(conn, h):
                raise ProtocolError(f"unexpected {h['type']!r} frame")

    def _handle_other(self, conn: socket.socket, header: dict) -> bool:
        """Requests beyond pull/release (subclasses: other data planes); False: not understood."""
        return False

    def _await_ack(self, conn: socket.socket, tid: str) -> None:
        """Wait for the consumer's ack of ``tid``, end the lease as pulled and confirm."""
        h, _ = recv_frame(conn, Deadline.after(self.io_timeout_s, self.io_timeout_s))
        if h["type"] != "ack" or h.get("transfer_id") != tid:
            raise ProtocolError(f"expected the ack of {tid}, got {h['type']!r}")
        self.leases.end(tid, "pulled")
        send_frame(conn, {"type": "done"}, deadline=Deadline.after(self.io_timeout_s, self.io_timeout_s))

    def _send_pages(self, conn: socket.socket, tid: str) -> None:
        d = Deadline.after(None, self.io_timeout_s)
        try:
            lease = self.leases.checkout(tid)
        except KVTransferError as e:
            code = "not_found" if isinstance(e, TransferNotFoundError) else "busy"
            send_frame(conn, {"type": "error", "code": code, "message": str(e)}, deadline=d)
            return
        acked = False
        try:
            try:
                arr = as_pages_array(lease.pages, self.layout)
            except Exception as e:
                send_frame(
                    conn,
                    {
                        "type": "error",
                        "code": "internal",
                        "message": f"pages of transfer {tid} are unavailable: {e}",
                    },
                    deadline=d,
                )
                raise
            header = {
                "type": "pages",
                "request_id": lease.request_id,
                "num_tokens": lease.num_tokens,
                "meta": lease.meta,
                "shape": list(arr.shape),
                "dtype": self.layout.dtype,
            }
            # One buffer per layer: arr[l] of a [L, n_pad, ...][:, :n] view is still contiguous.
            self._write_pages(conn, header, [_as_bytes_view(arr[l]) for l in range(arr.shape[0])], d)
            self._await_ack(conn, tid)
            acked = True
        finally:
            if not acked:
                self.leases.checkin(tid)

    def _write_pages(self, conn: socket.socket, header: dict, buffers: list, deadline: Deadline) -> None:
        """Send the pages frame (a seam tests use to fail a transfer half-way)."""
        send_frame(conn, header, buffers, deadline=deadline)


class TcpKVReceiver(KVReceiver):
    """The consumer's side: one connection per pull, every wait bounded."""

    def __init__(
        self,
        layout: KVLayout,
        secret: bytes | str | None = None,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        default_timeout_s: float | None = 300.0,
    ):
        self.layout = layout
        self._digest = layout.digest()
        self._secret = auth.load_secret(secret)
        self.connect_timeout_s = float(connect_timeout_s)
        self.io_timeout_s = float(io_timeout_s)
        self.default_timeout_s = default_timeout_s

    def _connect(self, handle: TransferHandle, d: Deadline) -> socket.socket:
        where = f"{handle.host}:{handle.port}"
        try:
            sock = socket.create_connection(
                (handle.host, handle.port), timeout=min(self.connect_timeout_s, d.next_wait())
            )
        except TimeoutError:
            raise TransferTimeoutError(f"connecting to the KV producer at {where} timed out") from None
        except OSError as e:
            raise PeerClosedError(f"cannot connect to the KV producer at {where}: {e}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._handshake(sock, where, d)
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket, where: str, d: Deadline) -> None:
        h, _ = recv_frame(sock, d)
        _raise_error_frame(h, where)  # a producer over its connection limits refuses in place of hello
        if h["type"] != "hello":
            raise ProtocolError(f"KV producer at {where} sent {h['type']!r} instead of 'hello'")
        nonce_p = _hex(h, "nonce", auth.NONCE_BYTES)
        nonce_c = auth.new_nonce()
        send_frame(
            sock,
            {
                "type": "auth",
                "nonce": nonce_c.hex(),
                "proof": auth.proof(self._secret, auth.CLIENT_LABEL, nonce_p, nonce_c).hex(),
            },
            deadline=d,
        )
        h, _ = recv_frame(sock, d)
        if h.get("code") == "auth_failed":
            raise AuthError(
                f"KV producer at {where} refused authentication: {h.get('message')} "
                f"(is {auth.SECRET_ENV} the same on both engines?)"
            )
        _raise_error_frame(h, where)
        if h["type"] != "ok":
            raise ProtocolError(f"KV producer at {where} sent {h['type']!r} instead of 'ok'")
        # The proof first: the layout of a producer that cannot prove the secret means nothing.
        digest_p = str(h.get("layout_digest", ""))
        want = auth.proof(self._secret, auth.SERVER_LABEL, nonce_c, nonce_p, digest_p.encode())
        if not auth.check_proof(want, _hex(h, "proof", 32)):
            raise AuthError(
                f"KV producer at {where} failed to prove it holds the shared secret "
                f"(is {auth.SECRET_ENV} the same on both engines?)"
            )
        if digest_p != self._digest:
            try:
                diffs = self.layout.differences(KVLayout.from_dict(h.get("layout")))
            except (ValueError, TypeError):
                diffs = [f"unreadable producer layout {h.get('layout')!r}"]
            raise LayoutMismatchError(
                f"KV layout of the producer at {where} differs from this "
                f"consumer's (ours != theirs): {'; '.join(diffs) or 'digest only'}"
            )
        # No answer awaited: the producer answers the next request with layout_mismatch if it disagrees.
        send_frame(sock, {"type": "layout", "layout_digest": self._digest}, deadline=d)

    def pull(self, handle: TransferHandle, timeout_s: float | None = None) -> PageBatch:
        where = f"{handle.host}:{handle.port}"
        # The handle's digest is not checked here: the handshake compares whole layouts and names
        # the fields that differ.
        d = Deadline.after(timeout_s if timeout_s is not None else self.default_timeout_s, self.io_timeout_s)
        with self._connect(handle, d) as sock:
            return self._pull_on(sock, handle, where, d)

    def _ack(self, sock: socket.socket, handle: TransferHandle, where: str, d: Deadline) -> None:
        send_frame(sock, {"type": "ack", "transfer_id": handle.transfer_id}, deadline=d)
        try:
            recv_frame(sock, d)  # 'done': the producer dropped its lease
        except KVTransferError as e:  # the pages are whole; the lease will expire instead
            log.warning("KV producer at %s did not confirm the ack of %s: %s", where, handle.transfer_id, e)

    def _pull_on(self, sock: socket.socket, handle: TransferHandle, where: str, d: Deadline) -> PageBatch:
        """The pull over an authenticated connection (subclasses: other data planes)."""
        send_frame(sock, {"type": "pull", "transfer_id": handle.transfer_id}, deadline=d)
        h, n = recv_header(sock, d)
        _raise_error_frame(h, where)
        if h["type"] != "pages":
            raise ProtocolError(f"KV producer at {where} sent {h['type']!r} instead of 'pages'")
        shape = self.layout.pages_shape(handle.num_pages)
        if (
            tuple(h.get("shape", ())) != shape
            or h.get("dtype") != self.layout.dtype
            or n != self.layout.pages_nbytes(handle.num_pages)
            or h.get("request_id") != handle.request_id
        ):
            raise ProtocolError(
                f"KV producer at {where} sent pages {h.get('shape')} "
                f"{h.get('dtype')} ({n} bytes) of request {h.get('request_id')!r}; "
                f"expected {list(shape)} {self.layout.dtype} of {handle.request_id!r}"
            )
        pages = np.empty(shape, dtype_from_name(self.layout.dtype))
        recv_into(sock, pages.reshape(-1).view(np.uint8).data, d, "KV pages")
        self._ack(sock, handle, where, d)
        meta = h.get("meta")
        num_tokens = int(h.get("num_tokens", handle.num_tokens))
        return PageBatch(handle.request_id, pages, num_tokens, meta if isinstance(meta, dict) else {})

    def release(self, handle: TransferHandle, timeout_s: float | None = None) -> bool:
        d = Deadline.after(
            timeout_s if timeout_s is not None else self.connect_timeout_s + self.io_timeout_s,
            self.io_timeout_s,
        )
        with self._connect(handle, d) as sock:
            send_frame(sock, {"type": "release", "transfer_id": handle.transfer_id}, deadline=d)
            h, _ = recv_frame(sock, d)
            _raise_error_frame(h, f"{handle.host}:{handle.port}")
            return bool(h.get("released"))

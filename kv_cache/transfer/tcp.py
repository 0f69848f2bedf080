"""The framed-TCP KV transport: ``TcpKVSender`` (producer, a listener) and ``TcpKVReceiver``.

One connection per pull. The exchange (frames from ``framing``; C = consumer, P = producer)::

    P -> C  hello    {nonce_p, layout, layout_digest}
    C -> P  auth     {nonce_c, layout_digest, proof_c = HMAC(secret, CLIENT_LABEL, nonce_p, nonce_c, digest)}
    P -> C  ok       {proof_p = HMAC(secret, SERVER_LABEL, nonce_c, nonce_p, digest)}
            | error  {code: auth_failed | layout_mismatch, message}
    C -> P  pull     {transfer_id}                        | release {transfer_id}
    P -> C  pages    {request_id, num_tokens, meta, shape, dtype} + raw bytes [L, n, ps, C, D] (C order)
            | error  {code: not_found | busy | internal, message}
    C -> P  ack      {transfer_id}          (the lease ends as "pulled" only now)
    P -> C  done     {}

Both sides prove the secret (the consumer must not accept pages from an impostor either); the
consumer checks the layout before authenticating, so a mismatch names the differing fields. The
page bytes themselves are not MAC'd: the listener binds 127.0.0.1 unless told otherwise, and a
network between hosts should be trusted or tunnelled. A failed or unacknowledged send leaves the
lease in place (the consumer may retry) until it expires.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid

import numpy as np

from tpuserve.kv_cache.transfer import auth
from tpuserve.kv_cache.transfer.errors import (AuthError, KVTransferError, LayoutMismatchError,
                                              PeerClosedError, ProtocolError, TransferNotFoundError,
                                              TransferTimeoutError)
from tpuserve.kv_cache.transfer.framing import Deadline, recv_frame, recv_header, recv_into, send_frame
from tpuserve.kv_cache.transfer.layout import KVLayout, dtype_from_name
from tpuserve.kv_cache.transfer.lease import Lease, LeaseTable
from tpuserve.kv_cache.transfer.transport import (KVReceiver, KVSender, LeaseEvent, PageBatch, PendingPages,
                                                  TransferHandle, as_pages_array)

log = logging.getLogger(__name__)

_ERRORS: dict[str, type[KVTransferError]] = {
    "auth_failed": AuthError, "layout_mismatch": LayoutMismatchError, "not_found": TransferNotFoundError,
}


def _as_bytes_view(a: np.ndarray) -> memoryview:
    """A flat byte view of ``a`` (copied only if not C-contiguous); works for ml_dtypes too."""
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _hex(header: dict, key: str, nbytes: int | None = None) -> bytes:
    v = header.get(key)
    try:
        b = bytes.fromhex(v)
    except (TypeError, ValueError):
        raise ProtocolError(f"{header.get('type')!r} frame: {key} is not hex") from None
    if nbytes is not None and len(b) != nbytes:
        raise ProtocolError(f"{header.get('type')!r} frame: {key} must be {nbytes} bytes")
    return b


def _raise_error_frame(header: dict, where: str) -> None:
    if header.get("type") == "error":
        code, msg = header.get("code"), header.get("message", "")
        raise _ERRORS.get(code, KVTransferError)(f"KV producer at {where}: {msg} [{code}]")


class TcpKVSender(KVSender):
    """The producer's listener: pages offered here are pulled over framed TCP.

    ``host`` is the bind address (loopback unless told otherwise); ``advertise_host`` is what
    handles name (default: ``host``). ``port=0`` picks a free port (see ``address``).
    """

    def __init__(self, layout: KVLayout, secret: bytes | str | None = None, host: str = "127.0.0.1",
                 port: int = 0, advertise_host: str | None = None, default_ttl_s: float = 120.0,
                 io_timeout_s: float = 30.0, handshake_timeout_s: float = 10.0,
                 max_held_bytes: int | None = None, max_connections: int = 64):
        self.layout = layout
        self._digest = layout.digest()
        self._secret = auth.load_secret(secret)
        self.default_ttl_s = float(default_ttl_s)
        self.io_timeout_s = float(io_timeout_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.leases = LeaseTable(max_held_bytes)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = threading.Event()
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.5)  # the accept loop checks for close this often
        bound = self._listener.getsockname()
        self.host, self.port = advertise_host or host, int(bound[1])
        self._threads = [threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True),
                         threading.Thread(target=self._reap_loop, name="kv-lease-reaper", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    # ---- the engine's API ----

    def offer(self, request_id: str, pages, num_tokens: int, meta: dict | None = None,
              ttl_s: float | None = None) -> TransferHandle:
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
        self.leases.add(Lease(tid, str(request_id), pages, n, int(num_tokens), dict(meta or {}),
                              self.layout.pages_nbytes(n), time.monotonic() + ttl))
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
        self._listener.close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> "TcpKVSender":
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
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                log.warning("KV sender: too many connections, refusing %s", peer)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="kv-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._handshake(conn):
                self._requests(conn)
        except KVTransferError as e:
            log.info("KV sender: connection from %s ended: %s", peer, e)
        except Exception:  # a bug must not kill the listener
            log.exception("KV sender: connection from %s failed", peer)
        finally:
            conn.close()
            self._slots.release()

    def _handshake(self, conn: socket.socket) -> bool:
        d = Deadline.after(self.handshake_timeout_s, self.handshake_timeout_s)
        nonce_p = auth.new_nonce()
        send_frame(conn, {"type": "hello", "nonce": nonce_p.hex(), "layout": self.layout.to_dict(),
                          "layout_digest": self._digest}, deadline=d)
        h, _ = recv_frame(conn, d)
        if h["type"] != "auth":
            raise ProtocolError(f"expected an 'auth' frame, got {h['type']!r}")
        nonce_c, got = _hex(h, "nonce", auth.NONCE_BYTES), _hex(h, "proof", 32)
        digest_c = str(h.get("layout_digest", ""))
        want = auth.proof(self._secret, auth.CLIENT_LABEL, nonce_p, nonce_c, digest_c.encode())
        if not auth.check_proof(want, got):
            send_frame(conn, {"type": "error", "code": "auth_failed",
                              "message": "authentication failed: the consumer's shared secret differs"},
                       deadline=d)
            raise AuthError("a consumer failed authentication")
        if digest_c != self._digest:
            send_frame(conn, {"type": "error", "code": "layout_mismatch",
                              "message": f"KV layout digest {digest_c} differs from the producer's "
                                         f"{self._digest} ({self.layout})"}, deadline=d)
            raise LayoutMismatchError("a consumer has a different KV layout")
        send_frame(conn, {"type": "ok", "proof": auth.proof(self._secret, auth.SERVER_LABEL, nonce_c,
                                                            nonce_p, self._digest.encode()).hex()},
                   deadline=d)
        return True

    def _requests(self, conn: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                h, _ = recv_frame(conn, Deadline.after(None, self.io_timeout_s))
            except PeerClosedError:
                return  # the consumer is done
            tid = str(h.get("transfer_id", ""))
            if h["type"] == "pull":
                self._send_pages(conn, tid)
            elif h["type"] == "release":
                ended = self.leases.end(tid, "released")
                send_frame(conn, {"type": "done", "released": ended},
                           deadline=Deadline.after(self.io_timeout_s, self.io_timeout_s))
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
                send_frame(conn, {"type": "error", "code": "internal",
                                  "message": f"pages of transfer {tid} are unavailable: {e}"}, deadline=d)
                raise
            header = {"type": "pages", "request_id": lease.request_id, "num_tokens": lease.num_tokens,
                      "meta": lease.meta, "shape": list(arr.shape), "dtype": self.layout.dtype}
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

    def __init__(self, layout: KVLayout, secret: bytes | str | None = None, connect_timeout_s: float = 5.0,
                 io_timeout_s: float = 30.0, default_timeout_s: float | None = 300.0):
        self.layout = layout
        self._digest = layout.digest()
        self._secret = auth.load_secret(secret)
        self.connect_timeout_s = float(connect_timeout_s)
        self.io_timeout_s = float(io_timeout_s)
        self.default_timeout_s = default_timeout_s

    def _connect(self, handle: TransferHandle, d: Deadline) -> socket.socket:
        where = f"{handle.host}:{handle.port}"
        try:
            sock = socket.create_connection((handle.host, handle.port),
                                            timeout=min(self.connect_timeout_s, d.next_wait()))
        except socket.timeout:
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
        if h["type"] != "hello":
            raise ProtocolError(f"KV producer at {where} sent {h['type']!r} instead of 'hello'")
        nonce_p = _hex(h, "nonce", auth.NONCE_BYTES)
        if h.get("layout_digest") != self._digest:
            try:
                diffs = self.layout.differences(KVLayout.from_dict(h.get("layout")))
            except (ValueError, TypeError):
                diffs = [f"unreadable producer layout {h.get('layout')!r}"]
            raise LayoutMismatchError(f"KV layout of the producer at {where} differs from this "
                                      f"consumer's (ours != theirs): {'; '.join(diffs) or 'digest only'}")
        nonce_c = auth.new_nonce()
        send_frame(sock, {"type": "auth", "nonce": nonce_c.hex(), "layout_digest": self._digest,
                          "proof": auth.proof(self._secret, auth.CLIENT_LABEL, nonce_p, nonce_c,
                                              self._digest.encode()).hex()}, deadline=d)
        h, _ = recv_frame(sock, d)
        if h.get("code") == "auth_failed":
            raise AuthError(f"KV producer at {where} refused authentication: {h.get('message')} "
                            f"(is {auth.SECRET_ENV} the same on both engines?)")
        _raise_error_frame(h, where)
        if h["type"] != "ok":
            raise ProtocolError(f"KV producer at {where} sent {h['type']!r} instead of 'ok'")
        want = auth.proof(self._secret, auth.SERVER_LABEL, nonce_c, nonce_p, self._digest.encode())
        if not auth.check_proof(want, _hex(h, "proof", 32)):
            raise AuthError(f"KV producer at {where} failed to prove it holds the shared secret "
                            f"(is {auth.SECRET_ENV} the same on both engines?)")

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
            log.warning("KV producer at %s did not confirm the ack of %s: %s", where,
                        handle.transfer_id, e)

    def _pull_on(self, sock: socket.socket, handle: TransferHandle, where: str, d: Deadline) -> PageBatch:
        """The pull over an authenticated connection (subclasses: other data planes)."""
        send_frame(sock, {"type": "pull", "transfer_id": handle.transfer_id}, deadline=d)
        h, n = recv_header(sock, d)
        _raise_error_frame(h, where)
        if h["type"] != "pages":
            raise ProtocolError(f"KV producer at {where} sent {h['type']!r} instead of 'pages'")
        shape = self.layout.pages_shape(handle.num_pages)
        if (tuple(h.get("shape", ())) != shape or h.get("dtype") != self.layout.dtype
                or n != self.layout.pages_nbytes(handle.num_pages)
                or h.get("request_id") != handle.request_id):
            raise ProtocolError(f"KV producer at {where} sent pages {h.get('shape')} "
                                f"{h.get('dtype')} ({n} bytes) of request {h.get('request_id')!r}; "
                                f"expected {list(shape)} {self.layout.dtype} of {handle.request_id!r}")
        pages = np.empty(shape, dtype_from_name(self.layout.dtype))
        recv_into(sock, memoryview(pages.reshape(-1).view(np.uint8)), d, "KV pages")
        self._ack(sock, handle, where, d)
        meta = h.get("meta") if isinstance(h.get("meta"), dict) else {}
        return PageBatch(handle.request_id, pages, int(h.get("num_tokens", handle.num_tokens)), meta)

    def release(self, handle: TransferHandle, timeout_s: float | None = None) -> bool:
        d = Deadline.after(timeout_s if timeout_s is not None else self.connect_timeout_s + self.io_timeout_s,
                           self.io_timeout_s)
        with self._connect(handle, d) as sock:
            send_frame(sock, {"type": "release", "transfer_id": handle.transfer_id}, deadline=d)
            h, _ = recv_frame(sock, d)
            _raise_error_frame(h, f"{handle.host}:{handle.port}")
            return bool(h.get("released"))

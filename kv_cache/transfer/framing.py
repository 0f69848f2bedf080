"""Length-prefixed frames over a stream socket: a JSON header, then raw payload bytes.

One frame on the wire::

    magic "TPKV" | version u8 | 3 zero bytes | header length u32 | payload length u64   (20 bytes)
    header: UTF-8 JSON object (its "type" says what it is)
    payload: raw bytes (page data), possibly empty

Every read runs under a deadline: a ``Deadline`` caps the whole exchange and ``io_timeout_s`` caps
each wait for bytes, so a peer that stops sending (or is stopped) surfaces as
``TransferTimeoutError`` and one that dies as ``PeerClosedError``; nothing blocks forever. Headers
are bounded in size and payload lengths are checked against what the reader expects before any
allocation. Nothing here deserializes anything but JSON.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tpuserve.kv_cache.transfer.errors import PeerClosedError, ProtocolError, TransferTimeoutError

MAGIC = b"TPKV"
VERSION = 2  # 2: the producer shows its layout only after the consumer authenticates
_PREFIX = struct.Struct(">4sB3xIQ")
MAX_HEADER_BYTES = 1 << 16
_CHUNK = 1 << 22  # bytes per send/recv call: progress is checked at least this often


@dataclass
class Deadline:
    """An absolute deadline (monotonic clock) plus a bound on each single wait."""

    at: float
    io_timeout_s: float

    @classmethod
    def after(cls, total_s: float | None, io_timeout_s: float) -> Deadline:
        return cls(float("inf") if total_s is None else time.monotonic() + total_s, io_timeout_s)

    def next_wait(self) -> float:
        """Seconds the next socket operation may block; TransferTimeoutError once past the deadline."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError("KV transfer deadline passed")
        return min(left, self.io_timeout_s)


def send_frame(
    sock: socket.socket,
    header: dict,
    payload: Sequence[memoryview | bytes] = (),
    deadline: Deadline | None = None,
) -> None:
    """Write one frame; ``payload`` is a list of buffers sent back to back (no joining copy)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    views = [memoryview(b).cast("B") for b in payload]
    total = sum(v.nbytes for v in views)
    _send_all(sock, _PREFIX.pack(MAGIC, VERSION, len(head), total) + head, deadline)
    for v in views:
        for i in range(0, v.nbytes, _CHUNK):
            _send_all(sock, v[i : i + _CHUNK], deadline)


def _send_all(sock: socket.socket, buf, deadline: Deadline | None) -> None:
    try:
        if deadline is not None:
            sock.settimeout(deadline.next_wait())
        sock.sendall(buf)
    except TimeoutError:
        raise TransferTimeoutError("timed out sending to the KV transfer peer") from None
    except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as e:
        raise PeerClosedError(f"KV transfer peer closed the connection while sending ({e})") from None


def recv_into(sock: socket.socket, buf: memoryview, deadline: Deadline, what: str = "data") -> None:
    """Fill ``buf`` completely; PeerClosedError on EOF, TransferTimeoutError past the deadline."""
    buf = buf.cast("B")
    got, n = 0, buf.nbytes
    while got < n:
        sock.settimeout(deadline.next_wait())
        try:
            k = sock.recv_into(buf[got : got + _CHUNK])
        except TimeoutError:
            raise TransferTimeoutError(
                f"KV transfer peer sent nothing for {deadline.io_timeout_s:g}s "
                f"while receiving {what} ({got} of {n} bytes)"
            ) from None
        except (ConnectionResetError, ConnectionAbortedError) as e:
            raise PeerClosedError(
                f"KV transfer peer reset the connection while sending {what} ({got} of {n} bytes; {e})"
            ) from None
        if k == 0:
            raise PeerClosedError(
                f"KV transfer peer closed the connection while sending {what} ({got} of {n} bytes received)"
            )
        got += k


def recv_header(sock: socket.socket, deadline: Deadline) -> tuple[dict, int]:
    """Read a frame's prefix and header: (header, payload length still to read)."""
    prefix = bytearray(_PREFIX.size)
    recv_into(sock, memoryview(prefix), deadline, "a frame prefix")
    magic, version, head_len, payload_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"not a tpuserve KV transfer peer (frame magic {bytes(magic)!r})")
    if version != VERSION:
        raise ProtocolError(f"KV transfer protocol version {version} (this end speaks {VERSION})")
    if head_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"frame header of {head_len} bytes exceeds {MAX_HEADER_BYTES}")
    head = bytearray(head_len)
    recv_into(sock, memoryview(head), deadline, "a frame header")
    try:
        header = json.loads(head.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"frame header is not JSON ({e})") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("frame header is not an object with a 'type'")
    return header, payload_len


def recv_frame(sock: socket.socket, deadline: Deadline, max_payload: int = 0) -> tuple[dict, bytes]:
    """A whole frame whose payload is at most ``max_payload`` bytes (control frames: 0)."""
    header, n = recv_header(sock, deadline)
    if n > max_payload:
        raise ProtocolError(
            f"{header['type']!r} frame carries {n} payload bytes, at most {max_payload} expected"
        )
    payload = bytearray(n)
    if n:
        recv_into(sock, memoryview(payload), deadline, f"a {header['type']!r} payload")
    return header, bytes(payload)

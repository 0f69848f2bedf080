"""KV pages over ``jax.experimental.transfer`` (device to device where the backend supports it),
gated by the authenticated framed-TCP control channel of ``tcp``.

JAX's transfer server has no authentication and binds ``[::]`` by default; here it binds the given
loopback address, and a pull id (a fresh random 63-bit integer per pull) and the server's address
are handed out only over the authenticated control connection, after the layout check::

    C -> P  jax_pull  {transfer_id}
    P -> C  jax_ready {uuid, address, shape, dtype, request_id, num_tokens, meta}
            (P has called await_pull(uuid, [pages]) on its transfer server)
    C       pulls [L, n, page_size, C, D] from address under uuid
    C -> P  ack, P -> C done (the lease ends as "pulled")

Left for later: an un-acked ``await_pull`` cannot be withdrawn from JAX's server (it stays until
pulled or the process ends), and the pages go through a host copy on the producer (``offer`` takes
host pages); a device-resident offer would make it device to device.
"""

from __future__ import annotations

import secrets
import socket
from typing import TYPE_CHECKING

from tpuserve.kv_cache.transfer.errors import KVTransferError, ProtocolError, TransferNotFoundError
from tpuserve.kv_cache.transfer.framing import Deadline, recv_frame, send_frame
from tpuserve.kv_cache.transfer.tcp import TcpKVReceiver, TcpKVSender, _raise_error_frame
from tpuserve.kv_cache.transfer.transport import PageBatch, TransferHandle, as_pages_array

if TYPE_CHECKING:  # jax is imported on use
    from jax.experimental.transfer import TransferConnection, TransferServer


def start_loopback_transfer_server(bind_host: str = "127.0.0.1") -> TransferServer:
    """A JAX transfer server on ``bind_host`` (never the default ``[::]``)."""
    import jax
    from jax.experimental import transfer

    client = jax.devices()[0].client
    return transfer.start_transfer_server(client, f"{bind_host}:0", [f"{bind_host}:0"])


class JaxKVSender(TcpKVSender):
    """A ``TcpKVSender`` whose consumers may also pull through JAX's transfer server."""

    transport_name = "jax"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._jax_server = start_loopback_transfer_server(self._listener.getsockname()[0])

    def offer(self, *args, **kwargs) -> TransferHandle:
        h = super().offer(*args, **kwargs)
        return TransferHandle(**{**h.__dict__, "transport": self.transport_name})

    def _handle_other(self, conn: socket.socket, header: dict) -> bool:
        if header["type"] != "jax_pull":
            return False
        import jax.numpy as jnp

        tid = str(header.get("transfer_id", ""))
        d = Deadline.after(self.io_timeout_s, self.io_timeout_s)
        try:
            lease = self.leases.checkout(tid)
        except KVTransferError as e:
            code = "not_found" if isinstance(e, TransferNotFoundError) else "busy"
            send_frame(conn, {"type": "error", "code": code, "message": str(e)}, deadline=d)
            return True
        acked = False
        try:
            arr = jnp.asarray(as_pages_array(lease.pages, self.layout))
            uid = secrets.randbits(63)
            self._jax_server.await_pull(uid, [arr])
            send_frame(
                conn,
                {
                    "type": "jax_ready",
                    "uuid": str(uid),
                    "address": self._jax_server.address(),
                    "shape": list(arr.shape),
                    "dtype": self.layout.dtype,
                    "request_id": lease.request_id,
                    "num_tokens": lease.num_tokens,
                    "meta": lease.meta,
                },
                deadline=d,
            )
            self._await_ack(conn, tid)
            acked = True
        finally:
            if not acked:
                self.leases.checkin(tid)
        return True


class JaxKVReceiver(TcpKVReceiver):
    """Pulls through JAX's transfer server; the control connection authenticates and checks layout."""

    def __init__(self, *args, bind_host: str = "127.0.0.1", **kwargs):
        super().__init__(*args, **kwargs)
        self._bind_host = bind_host
        self._jax_server: TransferServer | None = None
        self._conns: dict[str, TransferConnection] = {}

    def _pull_on(self, sock, handle: TransferHandle, where: str, d: Deadline) -> PageBatch:
        import jax
        import numpy as np
        from jax.sharding import SingleDeviceSharding

        send_frame(sock, {"type": "jax_pull", "transfer_id": handle.transfer_id}, deadline=d)
        h, _ = recv_frame(sock, d)
        _raise_error_frame(h, where)
        shape = self.layout.pages_shape(handle.num_pages)
        if (
            h["type"] != "jax_ready"
            or tuple(h.get("shape", ())) != shape
            or h.get("dtype") != self.layout.dtype
        ):
            raise ProtocolError(
                f"KV producer at {where} answered {h.get('type')!r} {h.get('shape')} "
                f"{h.get('dtype')}; expected jax_ready {list(shape)} {self.layout.dtype}"
            )
        if self._jax_server is None:
            self._jax_server = start_loopback_transfer_server(self._bind_host)
        addr = str(h["address"])
        conn = self._conns.get(addr) or self._jax_server.connect(addr)
        self._conns[addr] = conn
        spec = jax.ShapeDtypeStruct(
            shape, self.layout.np_dtype, sharding=SingleDeviceSharding(jax.devices()[0])
        )
        try:
            (pages,) = conn.pull(int(h["uuid"]), [spec])
            pages = np.asarray(pages)
        except Exception as e:  # XLA's runtime errors: one type for the caller's fallback
            raise KVTransferError(f"JAX transfer from {addr} failed: {e}") from e
        self._ack(sock, handle, where, d)
        meta = h.get("meta")
        num_tokens = int(h.get("num_tokens", handle.num_tokens))
        return PageBatch(handle.request_id, pages, num_tokens, meta if isinstance(meta, dict) else {})

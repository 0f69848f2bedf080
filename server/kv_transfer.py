"""The engine's side of disaggregated prefill/decode (``--kv-transfer-config``).

A *producer* (prefill engine) serves requests that carry ``kv_transfer_params={"do_remote_decode":
true}``: when one finishes, its prompt pages are copied off the device and offered under a lease
(``kv_cache/transfer``), and the response carries the ``kv_transfer_params`` a consumer pulls them
with. A *consumer* (decode engine) gets a request with those params: the front end pulls the pages
off the engine thread (``pull``), the scheduler admits the request with its prompt already computed
and the engine scatters the pages into the fresh device pages before the step (``import_pages``).
``kv_both`` does both. A failed pull either fails the request or recomputes the prompt
(``kv_load_failure_policy``).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from tpuserve.kv_cache.transfer.device_pages import DevicePageMover
from tpuserve.kv_cache.transfer.layout import KVLayout
from tpuserve.kv_cache.transfer.tcp import TcpKVReceiver, TcpKVSender
from tpuserve.kv_cache.transfer.transport import PageBatch, TransferHandle
from tpuserve.tpu_platform.config import KVTransferConfig

log = logging.getLogger(__name__)

# ``kv_connector_extra_config`` keys that tune the producer's listener (``TcpKVSender`` keywords;
# the defaults there suit one host or a trusted network).
LISTENER_OPTIONS: dict[str, type] = {
    "handshake_timeout_s": float,
    "idle_timeout_s": float,
    "max_connections": int,
    "max_connections_per_peer": int,
}


def listener_options(extra: dict | None) -> dict[str, Any]:
    """The listener settings given in ``kv_connector_extra_config``; ValueError naming a bad one."""
    out: dict[str, Any] = {}
    extra = extra or {}
    for key, kind in LISTENER_OPTIONS.items():
        if key not in extra:
            continue
        v = extra[key]
        if (
            not isinstance(v, (int, float))
            or isinstance(v, bool)
            or not 0 < v < float("inf")
            or (kind is int and not float(v).is_integer())
        ):
            what = "number of seconds" if kind is float else "integer"
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config.{key}={v!r}: must be a positive {what}"
            )
        out[key] = kind(v)
    return out


class KVTransferRole:
    def __init__(self, cfg: KVTransferConfig, model_id: str, kv_cache, tp_size: int = 1):
        self.cfg = cfg
        # vLLM's producers name themselves in every response (``remote_engine_id``); routers and
        # logs written for vLLM key on it, so keep it stable for the process (vLLM: a uuid).
        self.engine_id = cfg.engine_id or uuid.uuid4().hex
        self.tp_size = tp_size
        self.layout = KVLayout.from_cache_shape(model_id, tuple(kv_cache.shape), kv_cache.dtype)
        self.mover = DevicePageMover()
        self.sender = None
        self.receiver = None
        if cfg.kv_role.sends:
            self.sender = TcpKVSender(
                self.layout,
                host=cfg.kv_ip,
                port=cfg.kv_port,
                **listener_options(cfg.kv_connector_extra_config),
            )
            log.info("KV producer listening on %s:%d", *self.sender.address)
        if cfg.kv_role.receives:
            self.receiver = TcpKVReceiver(self.layout)

    @property
    def produces(self) -> bool:
        return self.sender is not None

    @property
    def consumes(self) -> bool:
        return self.receiver is not None

    def export(self, request_id: str, kv_cache, page_ids: list[int], num_tokens: int) -> dict[str, Any]:
        """Copy a finished prefill's pages off the device (dispatched now, so the caller may free
        and reuse them at once) and offer them; returns the params a consumer pulls them with."""
        assert self.sender is not None, "export() is a KV producer's"
        pages = self.mover.gather(kv_cache, page_ids)
        handle = self.sender.offer(request_id, pages, num_tokens)
        self.sender.drain_finished()  # lease bookkeeping: drop ended leases' events
        params = handle.to_kv_transfer_params()
        # vLLM's keys too (its NixlConnector's ``request_finished``), so a proxy or sidecar written
        # for vLLM finds what it logs and checks; the pages' ids are informative only (the lease
        # holds a copy), remote_host / remote_port are where the copy is pulled from.
        params.update(
            remote_engine_id=self.engine_id,
            remote_block_ids=[int(i) for i in page_ids],
            tp_size=self.tp_size,
        )
        return params

    def pull(self, params: dict[str, Any], timeout_s: float = 60.0) -> PageBatch:
        """Fetch a prefill's pages (blocking: call it off the engine thread). ValueError for bad
        params; a ``KVTransferError`` when the producer cannot deliver."""
        if self.receiver is None:
            raise ValueError(
                "kv_transfer_params: this server is not a KV consumer "
                "(start it with --kv-transfer-config kv_role kv_consumer or kv_both)"
            )
        return self.receiver.pull(TransferHandle.from_kv_transfer_params(params), timeout_s)

    def import_pages(self, kv_cache, pages, page_ids: list[int]):
        """Scatter received pages [L, n, ...] into device pages ``page_ids``; returns the new cache."""
        return self.mover.scatter(kv_cache, pages, page_ids)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

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
from typing import Any

from tpuserve.kv_cache.transfer.device_pages import DevicePageMover
from tpuserve.kv_cache.transfer.layout import KVLayout
from tpuserve.kv_cache.transfer.transport import PageBatch, TransferHandle
from tpuserve.tpu_platform.config import KVTransferConfig

log = logging.getLogger(__name__)


class KVTransferRole:
    def __init__(self, cfg: KVTransferConfig, model_id: str, kv_cache):
        from tpuserve.kv_cache.transfer.tcp import TcpKVReceiver, TcpKVSender

        self.cfg = cfg
        self.layout = KVLayout.from_cache_shape(model_id, tuple(kv_cache.shape), kv_cache.dtype)
        self.mover = DevicePageMover()
        self.sender = None
        self.receiver = None
        if cfg.kv_role in ("kv_producer", "kv_both"):
            self.sender = TcpKVSender(self.layout, host=cfg.kv_ip, port=cfg.kv_port)
            log.info("KV producer listening on %s:%d", *self.sender.address)
        if cfg.kv_role in ("kv_consumer", "kv_both"):
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
        pages = self.mover.gather(kv_cache, page_ids)
        handle = self.sender.offer(request_id, pages, num_tokens)
        self.sender.drain_finished()  # lease bookkeeping: drop ended leases' events
        return handle.to_kv_transfer_params()

    def pull(self, params: dict[str, Any], timeout_s: float = 60.0) -> PageBatch:
        """Fetch a prefill's pages (blocking: call it off the engine thread). ValueError for bad
        params; a ``KVTransferError`` when the producer cannot deliver."""
        if self.receiver is None:
            raise ValueError("kv_transfer_params: this server is not a KV consumer "
                             "(start it with --kv-transfer-config kv_role kv_consumer or kv_both)")
        return self.receiver.pull(TransferHandle.from_kv_transfer_params(params), timeout_s)

    def import_pages(self, kv_cache, pages, page_ids: list[int]):
        """Scatter received pages [L, n, ...] into device pages ``page_ids``; returns the new cache."""
        return self.mover.scatter(kv_cache, pages, page_ids)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

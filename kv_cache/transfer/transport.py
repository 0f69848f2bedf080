"""The KV transport interface: a producer offers a request's pages, a consumer pulls them.

Roles (vLLM's ``kv_role``): the prefill engine is the *producer* (``KVSender``), the decode engine
the *consumer* (``KVReceiver``); ``kv_both`` holds one of each.

    producer (P)                                   consumer (D)
    pages = gather(kv, page_ids)  [L, n, ps, C, D]
    handle = sender.offer(req_id, pages, meta)
      -> handle.to_kv_transfer_params() in P's HTTP response; the router copies it to D's request
                                                   handle = TransferHandle.from_kv_transfer_params(p)
                                                   batch = receiver.pull(handle)       (blocking)
                                                   kv = scatter(kv, batch.pages, local_page_ids)
    sender.drain_finished() -> LeaseEvent(req_id, "pulled" | "expired" | "released")

Pages are copies: once ``offer`` has them (a host array, or a pending device->host gather) the
producer may free and reuse its device pages; the lease holds only the copy, until the consumer
acknowledges the pull or the lease expires.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tpuserve.kv_cache.transfer.layout import KVLayout

LEASE_REASONS = ("pulled", "expired", "released")


@runtime_checkable
class PendingPages(Protocol):
    """Pages still on their way to host memory (e.g. ``device_pages.HostPages``)."""

    num_pages: int

    def numpy(self) -> np.ndarray:
        """Block until landed; ``[L, n, page_size, C, D]`` (may be a non-contiguous view)."""


@dataclass(frozen=True)
class TransferHandle:
    """Where and under which id a consumer pulls one request's pages (JSON-able)."""

    transfer_id: str  # random, unguessable; the key of the producer's lease
    request_id: str
    host: str
    port: int
    num_pages: int
    num_tokens: int  # prompt tokens whose K/V the pages hold
    layout_digest: str
    transport: str = "tcp"

    def to_kv_transfer_params(self) -> dict[str, Any]:
        """vLLM-style ``kv_transfer_params`` a prefill response carries to the decode request."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_transfer_id": self.transfer_id,
            "remote_request_id": self.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_num_pages": self.num_pages,
            "remote_num_tokens": self.num_tokens,
            "layout_digest": self.layout_digest,
            "transport": self.transport,
        }

    @classmethod
    def from_kv_transfer_params(cls, p: dict[str, Any]) -> TransferHandle:
        """ValueError naming the missing or mistyped key."""
        if "remote_transfer_id" not in p and "remote_block_ids" in p:
            # vLLM's NixlConnector answers block ids on its own side channel, with no lease id: a
            # consumer here cannot pull from it, and should say that rather than "missing key".
            raise ValueError(
                "kv_transfer_params.remote_transfer_id is missing: these params name a producer "
                "that is not tpuserve (vLLM's NIXL connector?); a tpuserve consumer pulls KV only "
                "from a tpuserve producer"
            )
        spec = {
            "remote_transfer_id": str,
            "remote_request_id": str,
            "remote_host": str,
            "remote_port": int,
            "remote_num_pages": int,
            "remote_num_tokens": int,
            "layout_digest": str,
        }
        for k, t in spec.items():
            if not isinstance(p.get(k), t) or isinstance(p.get(k), bool):
                raise ValueError(f"kv_transfer_params.{k} must be a {t.__name__}, got {p.get(k)!r}")
        return cls(
            p["remote_transfer_id"],
            p["remote_request_id"],
            p["remote_host"],
            p["remote_port"],
            p["remote_num_pages"],
            p["remote_num_tokens"],
            p["layout_digest"],
            str(p.get("transport", "tcp")),
        )


# The keys of vLLM's P/D protocol (its NixlConnector's ``kv_transfer_params``) with their JSON
# types. Proxies send every one as null on the prefill request, so null is always allowed.
_VLLM_KEYS: dict[str, type] = {
    "do_remote_decode": bool,
    "do_remote_prefill": bool,
    "remote_engine_id": str,
    "remote_request_id": str,
    "remote_block_ids": list,
    "remote_host": str,
    "remote_port": int,
    "tp_size": int,
}
# Ours: typed here when present; a pull needs them all (``TransferHandle.from_kv_transfer_params``).
_OWN_KEYS: dict[str, type] = {
    "remote_transfer_id": str,
    "remote_num_pages": int,
    "remote_num_tokens": int,
    "layout_digest": str,
    "transport": str,
}

_JSON_NAMES = {bool: "a boolean", int: "an integer", str: "a string", list: "a list"}


def _is_block_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_kv_transfer_params(p: dict[str, Any]) -> None:
    """ValueError naming the first known key whose value has the wrong type or range. Unknown
    keys pass: other connectors add their own (vLLM's ``pp_size``, ``remote_num_tokens``...)."""
    for key, kind in (_VLLM_KEYS | _OWN_KEYS).items():
        v = p.get(key)
        if v is None:
            continue
        if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
            want = _JSON_NAMES[kind]
            raise ValueError(f"kv_transfer_params.{key} must be {want} or null, got {v!r}")
    port = p.get("remote_port")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params.remote_port must be a TCP port in [1, 65535], got {port}")
    for key in ("tp_size", "remote_num_pages", "remote_num_tokens"):
        if p.get(key) is not None and p[key] < 1:
            raise ValueError(f"kv_transfer_params.{key} must be positive, got {p[key]}")
    ids = p.get("remote_block_ids")
    # vLLM sends one list of block ids, or one list per KV cache group (hybrid models).
    if ids is not None and not all(
        _is_block_id(i) or (isinstance(i, list) and all(_is_block_id(j) for j in i)) for i in ids
    ):
        raise ValueError(
            "kv_transfer_params.remote_block_ids must be a list of non-negative integers "
            f"(or of such lists), got {ids!r}"
        )


@dataclass
class PageBatch:
    """What a consumer receives: ``pages`` ``[L, n, page_size, C, D]`` plus the producer's metadata."""

    request_id: str
    pages: np.ndarray
    num_tokens: int
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LeaseEvent:
    """A lease ended: the producer no longer holds ``request_id``'s pages."""

    request_id: str
    transfer_id: str
    reason: str  # one of LEASE_REASONS


class KVSender(abc.ABC):
    """Producer side: holds offered pages under a lease until pulled or expired."""

    layout: KVLayout

    @abc.abstractmethod
    def offer(
        self,
        request_id: str,
        pages: np.ndarray | PendingPages,
        num_tokens: int,
        meta: dict | None = None,
        ttl_s: float | None = None,
    ) -> TransferHandle:
        """Hold ``pages`` ``[L, n, page_size, C, D]`` for a consumer; returns where to pull them."""

    @abc.abstractmethod
    def release(self, transfer_id: str) -> bool:
        """Drop a lease now (the request was aborted); False if it was not held."""

    @abc.abstractmethod
    def drain_finished(self) -> list[LeaseEvent]:
        """Leases that ended since the last call (pulled, expired or released)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving and drop every lease."""


class KVReceiver(abc.ABC):
    """Consumer side: pulls a handle's pages from its producer."""

    layout: KVLayout

    @abc.abstractmethod
    def pull(self, handle: TransferHandle, timeout_s: float | None = None) -> PageBatch:
        """The pages, bitwise as offered; a ``KVTransferError`` subclass on any failure."""

    @abc.abstractmethod
    def release(self, handle: TransferHandle, timeout_s: float | None = None) -> bool:
        """Tell the producer to drop the pages without pulling them (the request was aborted)."""


def as_pages_array(pages: np.ndarray | PendingPages, layout: KVLayout) -> np.ndarray:
    """The ``[L, n, page_size, C, D]`` numpy array behind ``pages``; ValueError if it does not fit."""
    arr = (
        pages.numpy()
        if isinstance(pages, PendingPages) and not isinstance(pages, np.ndarray)
        else np.asarray(pages)
    )
    if arr.ndim != 5 or arr.shape != layout.pages_shape(arr.shape[1]):
        l, _, ps, c, d = layout.pages_shape(0)
        raise ValueError(f"pages of shape {arr.shape} do not match the layout's [{l}, n, {ps}, {c}, {d}]")
    if arr.dtype != layout.np_dtype:
        raise ValueError(f"pages of dtype {arr.dtype} do not match the layout's {layout.dtype}")
    return arr

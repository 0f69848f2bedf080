"""The producer's leases: offered pages held per transfer id until pulled, released or expired.

Thread-safe (the transport's connection threads and the engine loop both touch it). A lease being
sent is marked busy so a second puller waits its turn (it gets a clear error rather than a second
copy in flight); a failed send makes it available again until it expires, so a consumer may retry.
Ended leases become ``LeaseEvent``s the engine drains to free what it tied to the request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from tpuserve.kv_cache.transfer.errors import KVTransferError, TransferNotFoundError
from tpuserve.kv_cache.transfer.transport import LeaseEvent


@dataclass
class Lease:
    transfer_id: str
    request_id: str
    pages: Any  # np.ndarray or PendingPages, [L, n, page_size, C, D]
    num_pages: int
    num_tokens: int
    meta: dict
    nbytes: int
    expires_at: float  # time.monotonic()
    busy: bool = False


class LeaseTable:
    """Leases by transfer id, with a cap on the bytes held (``None``: no cap)."""

    def __init__(self, max_held_bytes: int | None = None, clock=time.monotonic):
        self.max_held_bytes = max_held_bytes
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._events: list[LeaseEvent] = []
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)  # notified when a lease is added or ends

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(l.nbytes for l in self._leases.values())

    def add(self, lease: Lease) -> None:
        """ValueError on a duplicate id; KVTransferError when the byte cap would be passed."""
        with self._lock:
            if lease.transfer_id in self._leases:
                raise ValueError(f"transfer id {lease.transfer_id} is already leased")
            held = sum(l.nbytes for l in self._leases.values())
            if self.max_held_bytes is not None and held + lease.nbytes > self.max_held_bytes:
                raise KVTransferError(
                    f"producer holds {held} bytes of leased KV pages; "
                    f"{lease.nbytes} more would pass the cap of {self.max_held_bytes}"
                )
            self._leases[lease.transfer_id] = lease
            self.changed.notify_all()

    def checkout(self, transfer_id: str) -> Lease:
        """Mark a lease busy for sending; TransferNotFoundError if absent, KVTransferError if busy."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None:
                raise TransferNotFoundError(
                    f"no KV pages held under transfer id {transfer_id} "
                    f"(never offered, already pulled, or the lease expired)"
                )
            if lease.busy:
                raise KVTransferError(f"transfer {transfer_id} is being pulled by another consumer")
            lease.busy = True
            return lease

    def checkin(self, transfer_id: str) -> None:
        """A send failed: the lease (if still held) is available again."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is not None:
                lease.busy = False

    def end(self, transfer_id: str, reason: str) -> bool:
        """Drop a lease with ``reason``; False if it was not held."""
        with self._lock:
            lease = self._leases.pop(transfer_id, None)
            if lease is None:
                return False
            self._events.append(LeaseEvent(lease.request_id, transfer_id, reason))
            self.changed.notify_all()
            return True

    def expire(self) -> int:
        """End every lease past its expiry (a busy one too: its sender holds its own reference)."""
        now = self._clock()
        with self._lock:
            gone = [t for t, l in self._leases.items() if l.expires_at <= now]
            for t in gone:
                lease = self._leases.pop(t)
                self._events.append(LeaseEvent(lease.request_id, t, "expired"))
            if gone:
                self.changed.notify_all()
            return len(gone)

    def seconds_to_next_expiry(self) -> float | None:
        with self._lock:
            if not self._leases:
                return None
            return max(0.0, min(l.expires_at for l in self._leases.values()) - self._clock())

    def drain_events(self) -> list[LeaseEvent]:
        with self._lock:
            out, self._events = self._events, []
            return out

    def clear(self) -> None:
        with self._lock:
            for t, lease in self._leases.items():
                self._events.append(LeaseEvent(lease.request_id, t, "released"))
            self._leases.clear()
            self.changed.notify_all()

"""The host-memory tier of the prefix cache: KV pages kept in host RAM and brought back by hash.

The device cache is one array ``kv: [L, P, page_size, C, D]`` (``kv_cache/layout.py``). One *page*
here means page ``p`` across every layer, ``kv[:, p]: [L, page_size, C, D]``; the host keeps such
pages in *slots*. Three pieces, usable apart:

* ``HostPagePool``: slot-addressed storage and the two device transfers. ``save`` dispatches one
  jitted gather of the requested device pages whose output lands in host memory (JAX memory kind
  ``pinned_host``: the D2H copy is a DMA the device runs in order with the steps, without blocking
  Python); the landed array is copied into the slot array later (``max_inflight_saves`` batches in
  flight at most). ``load`` scatters slots into device pages in one donated update.
* ``HostSlotIndex``: which block hash sits in which slot, an LRU over them, and pins. No arrays and
  no JAX, so a scheduler in another process (vLLM's scheduler-side connector) can own the same
  bookkeeping and tell the worker which slot to use.
* ``HostKVTier``: both together, keyed by hash: the API the standalone engine uses.

Why the slots are one numpy array and not host-resident JAX arrays: JAX arrays are immutable, and
writing one slot of a host-resident array needs a computation placed in host memory, which not
every backend runs. A numpy array takes in-place slot writes, and a load gathers any set of slots
with one fancy index into a fresh contiguous staging array, which is then one H2D transfer. The
D2H half still uses the memory kinds (the gather lands directly in host memory, asynchronously);
the numpy copy out of it happens only when the batch is drained (past the in-flight bound, or
before a load that reads those slots, or ``wait``). The load transfers the fresh staging array to
device memory (``jax.device_put``), which every backend does, and then scatters it there.

Ordering: ``save`` must be called before the caller dispatches a step that overwrites those device
pages. JAX runs computations on one device in dispatch order and keeps a donated buffer alive until
earlier readers are done, so the gather reads the pages as they were when ``save`` was called.

Not thread-safe: one thread (the engine loop, or vLLM's worker) drives it.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")  # preferred first


@dataclass
class HostTierStats:
    """Counters since start (pages are whole pages across all layers)."""

    hit_pages: int = 0  # leading host hits reported by ``match``
    loaded_pages: int = 0  # pages scattered back into the device cache
    saved_pages: int = 0  # pages copied to host (hashes already held are not counted)
    bytes_loaded: int = 0
    bytes_saved: int = 0
    evicted_pages: int = 0  # host slots reused for a newer page


def host_memory_kind(device) -> str | None:
    """The host memory kind ``device`` offers (``pinned_host`` preferred), or None when it has none."""
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in HOST_MEMORY_KINDS:
        if kind in kinds:
            return kind
    return None


def page_bytes(cache_shape: Sequence[int], dtype) -> int:
    """Bytes of one page across layers: ``cache_shape`` ``[L, P, page_size, C, D]`` with P dropped."""
    if len(cache_shape) != 5:
        raise ValueError(f"cache_shape must be [L, P, page_size, C, D], got {tuple(cache_shape)}")
    l, _, ps, c, d = cache_shape
    return int(l * ps * c * d * np.dtype(dtype).itemsize)


def slots_for_bytes(capacity_bytes: int, bytes_per_page: int, flag: str = "--kv-offloading-size") -> int:
    """How many whole pages ``capacity_bytes`` of host memory holds; ValueError (naming ``flag``) if none."""
    if bytes_per_page <= 0:
        raise ValueError(f"page bytes must be positive, got {bytes_per_page}")
    n = int(capacity_bytes) // int(bytes_per_page)
    if n < 1:
        raise ValueError(
            f"{flag}: {capacity_bytes} bytes of host memory hold no KV page "
            f"(one page across all layers takes {bytes_per_page} bytes)"
        )
    return n


def warmup_pages(max_model_len: int, page_size: int, max_num_batched_tokens: int) -> int:
    """The most pages the warm-ups compile transfers for: a full-length request's worth, or one
    step's chunk plus a partial page, whichever is more (bigger batches compile on first use)."""
    return max(-(-int(max_model_len) // page_size), int(max_num_batched_tokens) // page_size + 1)


def _bucket(n: int) -> int:
    """The power of two >= n: index counts are padded to these so few programs compile."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@dataclass
class _PendingSave:
    host_pages: object  # jax.Array [n_pad, L, page_size, C, D] in host memory (or device if none)
    slots: np.ndarray  # [n] int64: where rows 0..n-1 go


class HostPagePool:
    """``num_slots`` host page slots ``[num_slots, L, page_size, C, D]`` and the device transfers.

    ``page_shape`` is ``(L, page_size, C, D)``. ``device`` is the device holding the KV cache
    (None: taken from the cache at the first transfer).
    """

    def __init__(
        self, num_slots: int, page_shape: Sequence[int], dtype, device=None, max_inflight_saves: int = 4
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if len(page_shape) != 4:
            raise ValueError(f"page_shape must be [L, page_size, C, D], got {tuple(page_shape)}")
        if max_inflight_saves < 1:
            raise ValueError(f"max_inflight_saves must be >= 1, got {max_inflight_saves}")
        self.num_slots = int(num_slots)
        self.page_shape = tuple(int(x) for x in page_shape)
        self.dtype = np.dtype(dtype)
        self.page_bytes = int(np.prod(self.page_shape)) * self.dtype.itemsize
        self.max_inflight_saves = int(max_inflight_saves)
        # Untouched pages of np.zeros are not committed by the OS until written.
        self.slots = np.zeros((self.num_slots, *self.page_shape), self.dtype)
        self._pending: collections.deque[_PendingSave] = collections.deque()
        self._device = None
        self._gather: Callable[..., Any] | None = None
        self._scatter: Callable[..., Any] | None = None
        self.memory_kind: str | None = None
        self._traces = 0
        if device is not None:
            self._bind(device)

    # ---- set-up ----

    def _bind(self, device) -> None:
        import jax
        from jax.sharding import SingleDeviceSharding

        self._device = device
        self.memory_kind = host_memory_kind(device)
        if self.memory_kind is None:
            log.warning(
                "device %s has no host memory kind: saved pages land in device memory "
                "first and are copied out when drained",
                device,
            )
        out = SingleDeviceSharding(device, memory_kind=self.memory_kind) if self.memory_kind else None

        def gather(kv, idx):
            self._traces += 1  # runs once per compiled shape
            return jax.numpy.moveaxis(kv[:, idx], 1, 0)  # [n, L, page_size, C, D]

        def scatter(kv, pages, idx):
            self._traces += 1
            # Padding indices are P (out of range): dropped, so they never touch a real page.
            return kv.at[:, idx].set(jax.numpy.moveaxis(pages, 0, 1), mode="drop")

        self._scatter_fn = scatter

        self._gather = jax.jit(gather, out_shardings=out)
        self._scatter = None  # bound with the first cache it sees: its output keeps that format

    def _scatter_for(self, kv):
        if self._scatter is None:
            # jax, and layout (which imports it), on use: this module imports without jax (HostSlotIndex)
            import jax

            from tpuserve.kv_cache.layout import cache_out_format

            self._scatter = jax.jit(self._scatter_fn, donate_argnums=(0,), out_shardings=cache_out_format(kv))
        return self._scatter

    def _check_cache(self, kv) -> None:
        if kv.ndim != 5 or (kv.shape[0], *kv.shape[2:]) != self.page_shape:
            raise ValueError(
                f"KV cache shape {tuple(kv.shape)} does not hold pages of shape "
                f"{self.page_shape} ([L, P, page_size, C, D] with P dropped)"
            )
        if np.dtype(kv.dtype) != self.dtype:
            raise ValueError(f"KV cache dtype {kv.dtype} differs from the host pool's {self.dtype}")
        devices = kv.devices()
        if len(devices) != 1:
            raise ValueError(
                f"the host tier handles a single-device KV cache, this one spans {len(devices)} devices"
            )
        if self._device is None:
            self._bind(next(iter(devices)))

    def check_pages(self, kv, pages: Sequence[int]) -> None:
        """ValueError unless ``kv`` fits this pool and every page id indexes it."""
        self._check_cache(kv)
        pages_a = np.asarray(pages, np.int64)
        if pages_a.size and (pages_a.min() < 0 or pages_a.max() >= kv.shape[1]):
            raise ValueError(f"device page out of range [0, {kv.shape[1]}): {pages_a.tolist()}")

    def _check(self, kv, slots: np.ndarray, pages: np.ndarray, unique_slots: bool) -> None:
        self._check_cache(kv)
        if slots.shape != pages.shape or slots.ndim != 1:
            raise ValueError(
                f"slots and pages must be equal-length lists, got {slots.shape} and {pages.shape}"
            )
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            raise ValueError(f"host slot out of range [0, {self.num_slots}): {slots.tolist()}")
        num_pages = kv.shape[1]
        if pages.size and (pages.min() < 0 or pages.max() >= num_pages):
            raise ValueError(f"device page out of range [0, {num_pages}): {pages.tolist()}")
        if unique_slots and len(set(slots.tolist())) != slots.size:
            raise ValueError(f"a host slot appears twice in one transfer: {slots.tolist()}")

    @property
    def compile_count(self) -> int:
        """Programs traced so far (gather and scatter, one per index bucket)."""
        return self._traces

    @property
    def num_inflight(self) -> int:
        return len(self._pending)

    # ---- transfers ----

    def save(self, kv, slots: Sequence[int], pages: Sequence[int]) -> None:
        """Dispatch the copy of device pages ``pages`` into host slots ``slots``; returns at once."""
        import jax.numpy as jnp

        slots_a, pages_a = np.asarray(slots, np.int64), np.asarray(pages, np.int64)
        self._check(kv, slots_a, pages_a, unique_slots=True)
        if not slots_a.size:
            return
        n = slots_a.size
        idx = np.zeros(_bucket(n), np.int32)  # padding gathers page 0 (reserved); rows dropped
        idx[:n] = pages_a
        assert self._gather is not None  # _check bound the pool to kv's device
        host = self._gather(kv, jnp.asarray(idx))
        self._pending.append(_PendingSave(host, slots_a))
        while len(self._pending) > self.max_inflight_saves:
            self._drain_one()

    def load(self, kv, slots: Sequence[int], pages: Sequence[int]):
        """Scatter host slots ``slots`` into device pages ``pages`` in one donated update.

        ``kv`` is donated: use the returned array instead. Pages must be distinct.
        """
        # jax, and layout (which imports it), on use: this module imports without jax (HostSlotIndex)
        import jax.numpy as jnp

        from tpuserve.kv_cache.layout import stage_for

        slots_a, pages_a = np.asarray(slots, np.int64), np.asarray(pages, np.int64)
        self._check(kv, slots_a, pages_a, unique_slots=False)  # one slot may fill several pages
        if not slots_a.size:
            return kv
        if len(set(pages_a.tolist())) != pages_a.size:
            raise ValueError(f"a device page appears twice in one load: {pages_a.tolist()}")
        self._drain_touching(slots_a)
        n_pad = _bucket(slots_a.size)
        staging = np.zeros((n_pad, *self.page_shape), self.dtype)
        staging[: slots_a.size] = self.slots[slots_a]  # fresh array: never written again
        idx = np.full(n_pad, kv.shape[1], np.int32)  # out of range -> dropped by the scatter
        idx[: pages_a.size] = pages_a
        staged = stage_for(kv, staging)
        return self._scatter_for(kv)(kv, staged, jnp.asarray(idx))

    def warmup(self, kv, max_pages: int):
        """Compile the gather and the scatter for every index bucket up to ``max_pages``.

        Touches no page (the gathers are discarded, the scatters' indices all dropped); ``kv`` is
        donated, use the returned cache.
        """
        # on use: layout imports jax, and this module imports without it (HostSlotIndex)
        from tpuserve.kv_cache.layout import warm_page_transfers

        self._check_cache(kv)
        return warm_page_transfers(
            kv, self._gather, self._scatter_for(kv), lambda b: (b, *self.page_shape), max_pages
        )

    def wait(self) -> None:
        """Finish every in-flight save (its pages are then in the slot array)."""
        while self._pending:
            self._drain_one()

    def _drain_one(self) -> None:
        p = self._pending.popleft()
        landed = np.asarray(p.host_pages)  # waits for the gather and its D2H copy
        self.slots[p.slots] = landed[: p.slots.size]

    def _drain_touching(self, slots: np.ndarray) -> None:
        """Drain (in order, so later writes win) up to the last pending save writing any of ``slots``."""
        wanted = set(slots.tolist())
        last = -1
        for i, p in enumerate(self._pending):
            if wanted.intersection(p.slots.tolist()):
                last = i
        for _ in range(last + 1):
            self._drain_one()


class HostSlotIndex:
    """Block hash -> host slot, with an LRU over unpinned entries. Pure bookkeeping (no arrays).

    A pinned hash (``pin``; counted) is never evicted: a caller pins the hashes it decided to load
    until the load has been issued.
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = int(num_slots)
        self._slot: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # oldest first
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._pins: dict[bytes, int] = {}
        self.evictions = 0

    def __contains__(self, h: bytes) -> bool:
        return h in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def slot(self, h: bytes) -> int:
        """The slot holding ``h``; KeyError naming the hash if it is not held."""
        try:
            return self._slot[h]
        except KeyError:
            raise KeyError(
                f"block hash {h.hex() if isinstance(h, bytes) else h!r} is not in the host tier"
            ) from None

    def match(self, hashes: Iterable[bytes]) -> int:
        """How many leading ``hashes`` are held; those become most recently used."""
        n = 0
        for h in hashes:
            if h not in self._slot:
                break
            self._slot.move_to_end(h)
            n += 1
        return n

    def touch(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            if h in self._slot:
                self._slot.move_to_end(h)

    def pin(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self.slot(h)  # KeyError if absent
            self._pins[h] = self._pins.get(h, 0) + 1

    def unpin(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            n = self._pins.get(h, 0)
            if n <= 0:
                raise RuntimeError(f"block hash {h.hex()} unpinned more often than pinned")
            if n == 1:
                del self._pins[h]
            else:
                self._pins[h] = n - 1

    def is_pinned(self, h: bytes) -> bool:
        return h in self._pins

    def insert(self, h: bytes) -> tuple[int, bytes | None] | None:
        """A slot for new hash ``h`` (most recently used): (slot, evicted hash or None).

        None when every slot is pinned (the caller skips this save: the tier is a cache).
        ValueError if ``h`` is already held.
        """
        if h in self._slot:
            raise ValueError(f"block hash {h.hex()} is already in the host tier")
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((v for v in self._slot if v not in self._pins), None)  # oldest unpinned
            if victim is None:
                return None
            slot = self._slot.pop(victim)
            evicted = victim
            self.evictions += 1
        self._slot[h] = slot
        return slot, evicted

    def remove(self, h: bytes) -> None:
        """Forget ``h`` (its slot becomes free); no-op if absent. Pinned hashes cannot be removed."""
        if h in self._pins:
            raise RuntimeError(f"block hash {h.hex()} is pinned")
        slot = self._slot.pop(h, None)
        if slot is not None:
            self._free.append(slot)


class HostKVTier:
    """The host tier keyed by prefix-cache block hash: a ``HostSlotIndex`` over a ``HostPagePool``.

    ``cache_shape`` is the device cache's ``[L, P, page_size, C, D]`` (padding of C included: pages
    are stored exactly as the device holds them). Slots = ``capacity_bytes`` // bytes of one page
    across layers; ValueError when that is < 1.
    """

    def __init__(
        self, capacity_bytes: int, cache_shape: Sequence[int], dtype, device=None, max_inflight_saves: int = 4
    ):
        self.page_bytes = page_bytes(cache_shape, dtype)
        self.num_slots = slots_for_bytes(capacity_bytes, self.page_bytes)
        l, _, ps, c, d = (int(x) for x in cache_shape)
        self.pool = HostPagePool(self.num_slots, (l, ps, c, d), dtype, device, max_inflight_saves)
        self.index = HostSlotIndex(self.num_slots)
        self.stats = HostTierStats()

    def __contains__(self, h: bytes) -> bool:
        return h in self.index

    def __len__(self) -> int:
        return len(self.index)

    @property
    def compile_count(self) -> int:
        return self.pool.compile_count

    def match(self, hashes: Sequence[bytes]) -> int:
        """Leading ``hashes`` the host holds (touched in the LRU); counted in ``stats.hit_pages``."""
        n = self.index.match(hashes)
        self.stats.hit_pages += n
        return n

    def pin(self, hashes: Iterable[bytes]) -> None:
        """Keep these hashes from eviction until ``unpin`` (between deciding and issuing a load)."""
        self.index.pin(hashes)

    def unpin(self, hashes: Iterable[bytes]) -> None:
        self.index.unpin(hashes)

    def save(self, kv_cache, items: Sequence[tuple[bytes, int]]) -> None:
        """Copy device pages ``(hash, device_page_id)`` to host; held hashes are skipped (touched).

        Dispatches before returning; call it before dispatching a step that overwrites those pages.
        A full tier evicts its least recently used unpinned pages; if every slot is pinned the
        remaining pages are not saved.
        """
        # Validate before the index changes, so a bad call leaves the tier as it was.
        self.pool.check_pages(kv_cache, [p for _, p in items])
        chosen: dict[int, int] = {}  # slot -> device page, in insertion order
        seen: set[bytes] = set()
        for h, page in items:
            if h in seen:
                continue
            seen.add(h)
            if h in self.index:
                self.index.touch((h,))
                continue
            got = self.index.insert(h)
            if got is None:
                log.debug("host tier: every slot pinned, a page was not saved")
                break
            slot, evicted = got
            if evicted is not None:
                self.stats.evicted_pages += 1
            # More new pages than slots: a slot handed out earlier in this call was reused, and
            # its earlier page (already evicted from the index) is not copied.
            chosen.pop(slot, None)
            chosen[slot] = int(page)
        slots, pages = list(chosen), list(chosen.values())
        self.pool.save(kv_cache, slots, pages)
        self.stats.saved_pages += len(slots)
        self.stats.bytes_saved += len(slots) * self.page_bytes

    def load(self, kv_cache, items: Sequence[tuple[bytes, int]]):
        """Scatter the host pages of ``(hash, device_page_id)`` into the cache: one donated update.

        Returns the new cache (``kv_cache`` is donated). KeyError naming the hash if one is absent.
        """
        slots = [self.index.slot(h) for h, _ in items]
        out = self.pool.load(kv_cache, slots, [int(p) for _, p in items])
        self.stats.loaded_pages += len(slots)
        self.stats.bytes_loaded += len(slots) * self.page_bytes
        return out

    def warmup(self, kv_cache, max_pages: int):
        """Compile the transfers for every index bucket up to ``max_pages``; touches no page.
        ``kv_cache`` is donated: use the returned cache."""
        return self.pool.warmup(kv_cache, max_pages)

    def wait(self) -> None:
        """Finish in-flight saves (tests, shutdown)."""
        self.pool.wait()

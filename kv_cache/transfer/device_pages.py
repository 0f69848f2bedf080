"""Device KV cache <-> host page arrays, the two ends of a transfer.

``gather`` reads pages ``page_ids`` of the device cache ``kv [L, P, page_size, C, D]`` into
``[L, n, page_size, C, D]`` with one jitted gather whose output lands in host memory (memory kind
``pinned_host`` where the device has it), and returns at once: a ``HostPages`` the transport
materializes when the consumer pulls. JAX runs computations on a device in dispatch order, so the
producer may free those device pages and dispatch the next step right after ``gather``.

``scatter`` writes received ``[L, n, page_size, C, D]`` host pages into device pages ``page_ids``
with one donated update (use the returned cache).

Page counts are padded to powers of two so few programs compile (``warmup`` compiles them all):
padded gather rows read page 0 (reserved) and are cut off on the host; padded scatter indices are
out of range and dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpuserve.kv_cache.host_tier import host_memory_kind


def _bucket(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _to_bits(x):
    """``x`` as unsigned ints of the same width (a free bitcast). Moving bits instead of floats keeps
    NaN payloads: XLA:CPU computes a bf16 scatter in f32 and canonicalizes every NaN on the way."""
    import jax
    import jax.numpy as jnp

    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{jnp.dtype(x.dtype).itemsize * 8}"))


def _from_bits(x, dtype):
    import jax

    return jax.lax.bitcast_convert_type(x, dtype)


def moves_bits(dtype, platform: str) -> bool:
    """Whether pages of ``dtype`` move as unsigned ints on ``platform``.

    Only 16-bit floats on XLA:CPU need it (see ``_to_bits``). Elsewhere the cache moves as floats:
    on a TPU a bitcast of the whole cache changes its tiled layout, and the compiler copies the
    cache on the way in and out (a v5e needed 23.5 GB of temporaries for an 11.7 GB cache). An f32
    cache moves as floats everywhere: bitcasting it makes XLA:CPU copy all of it on every import.
    """
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize == 2 and platform == "cpu"


def page_gather(kv, idx, as_bits: bool):
    """``kv [L, P, ...]`` pages ``idx [n]`` -> ``[L, n, ...]``."""
    if not as_bits:
        return kv[:, idx]
    return _from_bits(_to_bits(kv)[:, idx], kv.dtype)


def page_scatter(kv, pages, idx, as_bits: bool):
    """``kv`` with pages ``idx [n]`` set to ``pages [L, n, ...]``; out-of-range ids are dropped."""
    if not as_bits:
        return kv.at[:, idx].set(pages, mode="drop")
    out = _to_bits(kv).at[:, idx].set(_to_bits(pages), mode="drop")
    return _from_bits(out, kv.dtype)


@dataclass
class HostPages:
    """Pages on their way to host memory: ``array [L, n_pad, ...]``, of which the first ``num_pages``."""

    array: object  # jax.Array
    num_pages: int

    def numpy(self) -> np.ndarray:
        """``[L, n, page_size, C, D]`` (blocks until landed; a view, each layer's pages contiguous)."""
        return np.asarray(self.array)[:, : self.num_pages]


class DevicePageMover:
    """The jitted gather and donated scatter for single-device caches (bound at first use)."""

    def __init__(self):
        self._gather = self._scatter = None
        self._device = None
        self._traces = 0

    @property
    def compile_count(self) -> int:
        return self._traces

    def _bind(self, kv) -> None:
        # jax, and layout (which imports it), on use: kv_cache.transfer imports without jax
        import jax
        from jax.sharding import SingleDeviceSharding

        from tpuserve.kv_cache.layout import cache_out_format

        devices = kv.devices()
        if len(devices) != 1:
            raise ValueError(
                f"page transfer handles a single-device KV cache, this one spans {len(devices)} devices"
            )
        self._device = next(iter(devices))
        kind = host_memory_kind(self._device)

        as_bits = moves_bits(kv.dtype, self._device.platform)

        def gather(kv, idx):
            self._traces += 1
            return page_gather(kv, idx, as_bits)

        def scatter(kv, pages, idx):
            self._traces += 1
            return page_scatter(kv, pages, idx, as_bits)

        out = SingleDeviceSharding(self._device, memory_kind=kind) if kind else None
        self._gather = jax.jit(gather, out_shardings=out)
        # The updated cache keeps the format it came in (kv_cache/layout.py: cache_out_format).
        self._scatter = jax.jit(scatter, donate_argnums=(0,), out_shardings=cache_out_format(kv))

    def _ids(self, kv, page_ids: Sequence[int]) -> np.ndarray:
        if kv.ndim != 5:
            raise ValueError(f"KV cache must be [L, P, page_size, C, D], got shape {tuple(kv.shape)}")
        if self._gather is None:
            self._bind(kv)
        ids = np.asarray(page_ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= kv.shape[1]):
            raise ValueError(f"page ids out of range [0, {kv.shape[1]}): {ids.tolist()}")
        return ids

    def gather(self, kv, page_ids: Sequence[int]) -> HostPages:
        """Dispatch the copy of ``kv[:, page_ids]`` to host memory; returns without waiting."""
        import jax.numpy as jnp

        ids = self._ids(kv, page_ids)
        idx = np.zeros(_bucket(ids.size), np.int32)
        idx[: ids.size] = ids
        return HostPages(self._gather(kv, jnp.asarray(idx)), int(ids.size))

    def scatter(self, kv, pages: np.ndarray, page_ids: Sequence[int]):
        """Write ``pages [L, n, page_size, C, D]`` into device pages ``page_ids``; ``kv`` is donated."""
        # jax, and layout (which imports it), on use: kv_cache.transfer imports without jax
        import jax.numpy as jnp

        from tpuserve.kv_cache.layout import stage_for

        ids = self._ids(kv, page_ids)
        pages = np.asarray(pages)
        want = (kv.shape[0], ids.size, *kv.shape[2:])
        if pages.shape != want:
            raise ValueError(
                f"pages of shape {pages.shape} do not fit {ids.size} pages of this cache ({list(want)})"
            )
        if pages.dtype != np.dtype(kv.dtype):
            raise ValueError(f"pages of dtype {pages.dtype} differ from the cache's {kv.dtype}")
        if len(set(ids.tolist())) != ids.size:
            raise ValueError(f"a page id appears twice: {ids.tolist()}")
        if not ids.size:
            return kv
        n_pad = _bucket(ids.size)
        staging = np.zeros((kv.shape[0], n_pad, *kv.shape[2:]), pages.dtype)
        staging[:, : ids.size] = pages
        idx = np.full(n_pad, kv.shape[1], np.int32)  # out of range: dropped
        idx[: ids.size] = ids
        return self._scatter(kv, stage_for(kv, staging), jnp.asarray(idx))

    def warmup(self, kv, max_pages: int):
        """Compile the gather and scatter for every bucket up to ``max_pages``; touches no page.

        ``kv`` is donated; use the returned cache.
        """
        # on use: layout imports jax, and kv_cache.transfer imports without it
        from tpuserve.kv_cache.layout import warm_page_transfers

        self._ids(kv, [])
        return warm_page_transfers(
            kv, self._gather, self._scatter, lambda b: (kv.shape[0], b, *kv.shape[2:]), max_pages
        )

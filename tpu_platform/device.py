"""Device discovery through JAX: which backend, how many devices, how much memory, which dtype."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class DeviceInfo:
    backend: str  # "tpu", "gpu" or "cpu"
    device_count: int
    device_kind: str
    memory_bytes: int | None  # per device; None when the backend cannot say

    @property
    def is_accelerator(self) -> bool:
        return self.backend in ("tpu", "gpu")


# libtpu pins this much host memory for host<->device copies as the backend starts. Its default
# (4 GiB) took 5.2 of a v5e's 8.1 s backend start (no transparent hugepages there); 256 MiB starts
# in 2.1 s and decodes as fast, at ~2.4 s more to copy a 1B model's weights in (benchmarks/RESULTS.md,
# "Start-up on a TPU v5e", 2026-12-06).
TPU_PREMAPPED_BUFFER_BYTES = 256 << 20


def prepare_tpu_runtime() -> None:
    """Settings libtpu reads when the backend starts, so set before the first device query; a
    value already in the environment (the user's) is kept. Other backends ignore them."""
    os.environ.setdefault("TPU_PREMAPPED_BUFFER_SIZE", str(TPU_PREMAPPED_BUFFER_BYTES))


def discover() -> DeviceInfo:
    prepare_tpu_runtime()  # a no-op once the backend runs: it reads them only when it starts
    devices = jax.devices()
    backend = jax.default_backend()
    memory = None
    try:
        stats = devices[0].memory_stats() or {}
        memory = stats.get("bytes_limit")
    except Exception:  # CPU devices raise or return None depending on the jax version
        memory = None
    if memory is None and backend == "cpu":
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            memory = None
    return DeviceInfo(backend, len(devices), devices[0].device_kind, memory)


def resolve_dtype(dtype: str, info: DeviceInfo):
    """'auto' is bf16 on accelerators and f32 on CPU (no native bf16 math there)."""
    if dtype == "auto":
        return jnp.bfloat16 if info.is_accelerator else jnp.float32
    return _DTYPES[dtype]


def enable_compilation_cache(path: str | None = None) -> str:
    """Persist XLA executables so a restart skips compilation. Returns the directory used."""
    path = path or os.path.join(os.path.expanduser("~"), ".cache", "tpuserve", "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class HostSource:
    """A parameter not read yet: its ``shape`` and ``dtype``, and ``read(index)``, which returns
    the values at ``index`` (a tuple of one slice per axis) in ``dtype`` (a numpy or jax array).

    The loader hands these out on a mesh over several processes (loader/__init__.py), so that
    ``place`` reads on each host only the slices its own devices hold, straight from the
    checkpoint's files. Anything else that needs the whole value reads it (``read_whole``)."""

    def __init__(self, shape: tuple[int, ...], dtype, read: Callable[[tuple[slice, ...]], Any]):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.read = read

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def whole(self):
        return self.read(tuple(slice(0, n) for n in self.shape))

    def layer(self, i: int) -> HostSource:
        """Layer ``i`` of a stacked [L, ...] source (``models/weights.unstack_layers``)."""
        return HostSource(self.shape[1:], self.dtype, lambda index: self.read((slice(i, i + 1), *index))[0])

    def columns(self, columns: np.ndarray) -> HostSource:
        """``self[..., columns]`` (int [M]), still read slice by slice: a slice of the result reads
        each contiguous run of the columns it covers from this source, nothing else."""
        columns = np.asarray(columns, np.int64)

        def read(index):
            index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
            start, stop, _ = index[-1].indices(len(columns))
            cols = columns[start:stop]
            if len(cols) == 0:
                return np.empty(
                    (*(len(range(*s.indices(n))) for s, n in zip(index[:-1], self.shape)), 0), self.dtype
                )
            # runs of consecutive source columns: one read each
            breaks = np.flatnonzero(np.diff(cols) != 1) + 1
            parts = [
                np.asarray(self.read((*index[:-1], slice(int(run[0]), int(run[-1]) + 1))))
                for run in np.split(cols, breaks)
            ]
            return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)

        return HostSource((*self.shape[:-1], len(columns)), self.dtype, read)

    def __repr__(self) -> str:
        return f"HostSource({self.shape}, {self.dtype})"


def read_whole(tree: Any) -> Any:
    """``tree`` with every ``HostSource`` read whole and put on the default device (what a
    single-process load hands out), for the steps that transform whole weights (KV-head
    replication, online quantization)."""

    def one(x):
        if not isinstance(x, HostSource):
            return x
        value = x.whole()
        return jax.device_put(value) if isinstance(value, np.ndarray) else value

    return jax.tree_util.tree_map(one, tree)


def _slice_key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


def place(x: Any, sharding: Any) -> Any:
    """``jax.device_put(x, sharding)`` of a host value. On a mesh over several processes each
    builds its own shards from its copy of ``x`` (every host holds the same value: the same
    weights, the same step inputs from the leader), instead of device_put's cross-host equality
    check, which all-gathers the whole value on every call: the weights' full bytes at load, a
    collective per step input, and collectives whose order would differ between hosts when a
    warm-up thread pool puts arrays.

    A ``HostSource`` is read here: over several processes, only the slices this process's
    devices hold, each once (devices holding the same slice, replicas, share one read)."""
    if isinstance(x, HostSource):
        if sharding is None or sharding.is_fully_addressable:
            return jax.device_put(x.whole(), sharding)
        reads = {}  # slice -> its values: devices holding the same slice share one read

        def shard(index):
            key = _slice_key(index)
            if key not in reads:
                reads[key] = x.read(tuple(index))
            return reads[key]

        return jax.make_array_from_callback(x.shape, sharding, shard)
    if sharding is None or sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        # already a global array (weights placed and quantized on the devices): every process
        # reshards it alike, or keeps it where it is
        return x if x.sharding.is_equivalent_to(sharding, x.ndim) else jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

"""Device discovery through JAX: which backend, how many devices, how much memory, which dtype."""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def discover() -> DeviceInfo:
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


def place(x, sharding):
    """``jax.device_put(x, sharding)`` of a host value. On a mesh over several processes each
    builds its own shards from its copy of ``x`` (every host holds the same value: the same
    weights, the same step inputs from the leader), instead of device_put's cross-host equality
    check, which all-gathers the whole value on every call: the weights' full bytes at load, a
    collective per step input, and collectives whose order would differ between hosts when a
    warm-up thread pool puts arrays."""
    if sharding is None or sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

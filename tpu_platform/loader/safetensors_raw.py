"""Read safetensors tensors in their stored dtype, fp8 included, as memory-mapped numpy arrays.

The safetensors package's numpy and flax readers name fp8 dtypes through ``numpy`` attributes that
do not exist (``np.float8_e4m3fn``), so pre-quantized checkpoints cannot be read with them. The file
format is simple enough to read directly: an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets relative to the end of the
header), then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import struct
import threading

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


# Bytes of tensor data handed out by every reader of this process: whole tensors by ``get``, the
# slices a sharded load copies out of ``view``'s arrays by ``count`` (tests check that a host of a
# multi-process engine reads about its share of the checkpoint).
_read_lock = threading.Lock()
_bytes_read = 0


def bytes_read() -> int:
    """Tensor bytes read from safetensors files by this process so far."""
    return _bytes_read


def count(nbytes: int) -> None:
    """Charge ``nbytes`` read out of a ``view`` to this process's ``bytes_read``."""
    global _bytes_read
    with _read_lock:
        _bytes_read += int(nbytes)


class SafetensorsFiles:
    """Every tensor of a set of ``.safetensors`` files by name; ``get`` returns a read-only
    memory-mapped array (copy it to keep it past the file's lifetime)."""

    def __init__(self, files: list[str]):
        self._where: dict[str, tuple[str, int, dict]] = {}
        for path in files:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    self._where[name] = (path, 8 + n, info)

    def keys(self):
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray | None:
        """The whole tensor (read as it is used), charged to ``bytes_read`` in full."""
        t = self.view(name)
        if t is not None:
            count(t.nbytes)
        return t

    def view(self, name: str) -> np.ndarray | None:
        """``get`` without the charge: for a reader that copies only slices of it and charges
        those (``count``)."""
        hit = self._where.get(name)
        if hit is None:
            return None
        path, base, info = hit
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=base + begin, shape=shape)

"""``KVLayout``: what a producer and a consumer must agree on before pages can move between them.

Two engines can exchange raw page bytes only if a page means the same thing on both: same model,
same page size, same number of layers, same combined-head width ``C`` (2*Hkv plus any padding the
attention impl adds), same head dim, same dtype and the same tensor-parallel split. The digest is a
SHA-256 over a canonical JSON of those fields; the handshake compares digests and, on a mismatch,
the full layouts, so the error names the field that differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np


def dtype_name(dtype) -> str:
    """Canonical name of a numpy/ml_dtypes/jax dtype: 'float32', 'bfloat16', 'float8_e4m3fn', ..."""
    return np.dtype(dtype).name


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype called ``name`` (ml_dtypes' extension types included); ValueError if unknown."""
    try:
        return np.dtype(name)
    except TypeError:
        pass
    import ml_dtypes  # bfloat16, float8_*: registered by ml_dtypes, which jax depends on

    t = getattr(ml_dtypes, name, None)
    if t is None:
        raise ValueError(f"unknown KV dtype {name!r}")
    return np.dtype(t)


@dataclass(frozen=True)
class KVLayout:
    """The page layout of one engine's KV cache ``[L, P, page_size, C, D]`` (P excluded)."""

    model_id: str
    num_layers: int  # L
    page_size: int
    combined_heads: int  # C: 2*Hkv (interleaved K/V) plus the impl's padding, per TP shard
    head_dim: int  # D
    dtype: str  # dtype_name() of the cache
    tp_size: int = 1

    def __post_init__(self):
        for f in ("num_layers", "page_size", "combined_heads", "head_dim", "tp_size"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"KVLayout.{f} must be >= 1, got {getattr(self, f)}")
        dtype_from_name(self.dtype)  # ValueError if unknown

    @classmethod
    def from_cache_shape(cls, model_id: str, cache_shape: Sequence[int], dtype, tp_size: int = 1) -> KVLayout:
        """From the device cache's ``[L, P, page_size, C, D]`` shape and dtype."""
        if len(cache_shape) != 5:
            raise ValueError(f"cache_shape must be [L, P, page_size, C, D], got {tuple(cache_shape)}")
        l, _, ps, c, d = (int(x) for x in cache_shape)
        return cls(model_id, l, ps, c, d, dtype_name(dtype), int(tp_size))

    @property
    def np_dtype(self) -> np.dtype:
        return dtype_from_name(self.dtype)

    def pages_shape(self, num_pages: int) -> tuple[int, int, int, int, int]:
        """Shape of ``num_pages`` pages on the wire: ``[L, n, page_size, C, D]``."""
        return (self.num_layers, int(num_pages), self.page_size, self.combined_heads, self.head_dim)

    def pages_nbytes(self, num_pages: int) -> int:
        return int(np.prod(self.pages_shape(num_pages))) * self.np_dtype.itemsize

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> KVLayout:
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or not names.issuperset(d) or "model_id" not in d:
            raise ValueError(f"not a KV layout: {d!r}")
        return cls(**d)

    def digest(self) -> str:
        """Hex SHA-256 of the canonical JSON of every field."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"tpuserve-kv-layout-v1\0" + blob).hexdigest()

    def differences(self, other: KVLayout) -> list[str]:
        """``"field: ours != theirs"`` for each field that differs (empty when equal)."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

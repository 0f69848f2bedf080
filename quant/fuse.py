"""Fusing per-projection records along the output axis (q|k|v -> qkv, gate|up -> gate_up).

Checkpoints quantize each projection on its own; the decoder multiplies by fused weights
(``tpu_platform/models/weights.py``: qkv ``[H, Hkv, G+2, D]`` grouped by KV head, gate_up
``[H, 2, F]``). Both are a concatenation of columns then a column permutation, which is exact for a
record when every scale is per column along N:

* FP8: a scale block ``(bk, bn)`` becomes ``(bk, 1)`` by repeating each scale over its ``bn``
  columns (per-tensor ``(K, N)`` becomes per-channel ``(K, 1)``); values are unchanged.
* MXFP4: scales are already per column (blocks run along K only).
* NVFP4: the per-tensor global scale becomes per column (``[1, N]``) when the fused tensors'
  globals differ; when they are equal (llm-compressor fuses them on purpose) it stays ``[1, 1]``.

All functions take and return 2-D records (no leading layer axes): ``[K, N]`` data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from tpuserve.quant.fp4 import Mxfp4Weight, Nvfp4Weight
from tpuserve.quant.fp8 import Fp8Weight, scale_columns


@dataclasses.dataclass(frozen=True)
class ArrayOps:
    """How ``concat_out`` / ``take_out`` build a fused record's arrays: jnp by default; the loader's
    per-slice reads pass lazy ones (tpu_platform/models/weights.py) that read nothing yet."""

    concat: Callable[[list], Any]  # arrays [..., N_i] -> [..., sum N_i]
    take: Callable[[Any, np.ndarray], Any]  # (array [..., N], int columns [M]) -> [..., M]


JNP_OPS = ArrayOps(
    concat=lambda xs: jnp.concatenate(xs, axis=-1),
    take=lambda a, index: jnp.take(a, jnp.asarray(index, jnp.int32), axis=-1),
)


def gate_up_in_out(w, stacked: bool):
    """A dense gate_up as ``[in, *out]`` ([.., H, 2, F]) from the decoder tree's [.., 2, H, F]
    (tpu_platform/models/weights.py): the form quantizers and the tensor-parallel grouping take.
    Anything else (a record, a bias) is returned as is."""
    return w.swapaxes(-3, -2) if hasattr(w, "ndim") and w.ndim == 3 + stacked else w


def columnwise(w):
    """The same weight with every scale per output column (see the module docstring)."""
    if isinstance(w, Fp8Weight):
        if w.block[1] == 1:
            return w
        return dataclasses.replace(w, scale=scale_columns(w), block=(w.block[0], 1))
    if isinstance(w, (Mxfp4Weight, Nvfp4Weight)):
        return w
    raise TypeError(f"not a quantized weight record: {type(w).__name__}")


def _data_fields(w) -> tuple[str, ...]:
    if isinstance(w, Fp8Weight):
        return ("qweight", "scale")
    if isinstance(w, Mxfp4Weight):
        return ("packed", "scale")
    return ("packed", "scale", "global_scale")


def concat_out(ws: list, out_shape: tuple[int, ...] | None = None, ops: ArrayOps = JNP_OPS):
    """Records ``[K, N_i]`` of one type and K -> one record ``[K, sum N_i]`` (columns in order).

    out_shape: the fused record's output axes (default: flat ``(sum N_i,)``).
    """
    ws = [columnwise(w) for w in ws]
    first = ws[0]
    if any(type(w) is not type(first) for w in ws):
        raise ValueError(f"cannot fuse records of different types: {[type(w).__name__ for w in ws]}")
    if any(w.in_features != first.in_features for w in ws):
        raise ValueError(f"cannot fuse records with different in_features: {[w.in_features for w in ws]}")
    n = sum(w.out_features for w in ws)
    out_shape = tuple(out_shape) if out_shape else (n,)
    if isinstance(first, Fp8Weight):
        if len({w.block[0] for w in ws}) != 1 or len({w.act_quant for w in ws}) != 1:
            raise ValueError("cannot fuse FP8 records with different K blocks or activation schemes")
        return Fp8Weight(
            ops.concat([w.qweight for w in ws]),
            ops.concat([w.scale for w in ws]),
            (first.block[0], 1),
            out_shape,
            first.act_quant,
        )
    if len({w.k_tile for w in ws}) != 1:  # along N the tiled K order fuses as it is
        raise ValueError("cannot fuse FP4 records with different K orders (k_tile)")
    packed = ops.concat([w.packed for w in ws])
    scale = ops.concat([w.scale for w in ws])
    if isinstance(first, Mxfp4Weight):
        if len({w.rotated for w in ws}) != 1:
            raise ValueError("cannot fuse rotated and plain MXFP4 records")
        return Mxfp4Weight(packed, scale, out_shape, first.rotated, first.k_tile)
    if len({w.global_divides for w in ws}) != 1:
        raise ValueError("cannot fuse NVFP4 records of both global-scale conventions")
    gs = [np.asarray(w.global_scale, np.float32) for w in ws]
    if all(g.size == 1 for g in gs) and len({g.reshape(()).item() for g in gs}) == 1:
        g = first.global_scale
    else:  # keep each tensor's own number (exact), one per column
        g = ops.concat(
            [
                np.broadcast_to(np.asarray(w.global_scale, np.float32).reshape(1, -1), (1, w.out_features))
                for w in ws
            ]
        )
    return Nvfp4Weight(packed, scale, g, out_shape, first.global_divides, first.k_tile)


def take_out(w, index, out_shape: tuple[int, ...], ops: ArrayOps = JNP_OPS):
    """Columns of ``w`` reordered by ``index`` (int ``[N]``), with output axes ``out_shape``."""
    w = columnwise(w)
    index = np.asarray(index, np.int32)
    fields = {}
    for name in _data_fields(w):
        a = getattr(w, name)
        fields[name] = a if a.shape[-1] == 1 else ops.take(a, index)
    return dataclasses.replace(w, out_shape=tuple(out_shape), **fields)

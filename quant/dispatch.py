"""Where a quantized ``linear`` runs: the Pallas TPU kernels on a TPU, XLA everywhere else.

``quant_linear`` serves every record type (``RECORD_TYPES``: ``Fp8Weight``, ``Mxfp4Weight``,
``Nvfp4Weight``); the model's ``linear`` routes records here through a runner's table
(``tpu_platform.linear.quant_linear_impls()``; quant/ knows nothing of the model).
"""

from __future__ import annotations

import dataclasses

import jax

from tpuserve.quant.fp4 import Mxfp4Weight, Nvfp4Weight, hadamard_blocks
from tpuserve.quant.fp8 import Fp8Weight
from tpuserve.quant.linear_xla import XLA_IMPLS
from tpuserve.quant.pallas_tpu_matmul import layer_of, quant_linear_tpu

RECORD_TYPES = (Fp8Weight, Mxfp4Weight, Nvfp4Weight)
IMPLS = ("auto", "xla", "pallas_tpu")


def quant_linear(x, w, bias=None, out_dtype=None, *, impl: str = "auto", interpret=None, layer=None):
    """``x [..., K] @ w (+ bias) -> [..., *w.out_shape]`` for a quantized record.

    impl "auto" decides at trace time from ``jax.default_backend()`` (tpu -> the Pallas kernels),
    so one registration serves every backend. ``interpret`` (a ``pltpu.InterpretParams``) runs the
    Pallas path in TPU interpret mode, for tests on CPU.
    layer: ``w`` is stacked over layers (``[L, K, ...]``, a layer scan's) and this i32 scalar picks
    the layer; the kernels read it in place, the XLA path slices it (XLA fuses that slice).
    """
    if impl == "auto":
        impl = "pallas_tpu" if jax.default_backend() == "tpu" else "xla"
    if isinstance(w, Mxfp4Weight) and w.rotated:  # (x R) @ (R W): rotate x, then a plain MXFP4 matmul
        x = hadamard_blocks(x)
        w = dataclasses.replace(w, rotated=False)
    if impl == "pallas_tpu" and _weight_ndim(w) == (2 if layer is None else 3):
        return quant_linear_tpu(x, w, bias, out_dtype, layer=layer, interpret=interpret)
    if layer is not None:
        w = layer_of(w, layer)
    return XLA_IMPLS[type(w)](x, w, bias, out_dtype)


def _weight_ndim(w) -> int:
    """The kernels take one layer's record, or a stack of them with a layer index; anything else
    (several leading axes) goes through XLA."""
    return (w.qweight if isinstance(w, Fp8Weight) else w.packed).ndim

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
from tpuserve.quant.pallas_tpu_matmul import quant_linear_tpu

RECORD_TYPES = (Fp8Weight, Mxfp4Weight, Nvfp4Weight)
IMPLS = ("auto", "xla", "pallas_tpu")


def quant_linear(x, w, bias=None, out_dtype=None, *, impl: str = "auto", interpret=None):
    """``x [..., K] @ w (+ bias) -> [..., *w.out_shape]`` for a quantized record.

    impl "auto" decides at trace time from ``jax.default_backend()`` (tpu -> the Pallas kernels),
    so one registration serves every backend. ``interpret`` (a ``pltpu.InterpretParams``) runs the
    Pallas path in TPU interpret mode, for tests on CPU.
    """
    if impl == "auto":
        impl = "pallas_tpu" if jax.default_backend() == "tpu" else "xla"
    if isinstance(w, Mxfp4Weight) and w.rotated:  # (x R) @ (R W): rotate x, then a plain MXFP4 matmul
        x = hadamard_blocks(x)
        w = dataclasses.replace(w, rotated=False)
    if impl == "pallas_tpu" and w_is_2d(w):
        return quant_linear_tpu(x, w, bias, out_dtype, interpret=interpret)
    return XLA_IMPLS[type(w)](x, w, bias, out_dtype)


def w_is_2d(w) -> bool:
    """The kernels take one layer's record; a still-stacked one (leading L) goes through XLA."""
    return (w.qweight if isinstance(w, Fp8Weight) else w.packed).ndim == 2

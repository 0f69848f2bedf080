"""Grouped matmul: rows of ``lhs`` sorted by group (expert), each group times its own weight.

The MoE layer sorts its (token, expert) pairs by expert, so expert ``g`` owns the consecutive rows
``start_g .. start_g + group_sizes[g] - 1``; one call then runs every expert's matmul.
``grouped_matmul`` is the entry point; ``grouped_matmul_reference`` defines what it computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from tpuserve.moe.pallas_tpu_gmm import grouped_matmul_tpu
from tpuserve.quant.fp4 import Mxfp4Weight, dequantize_mxfp4

IMPLS = ("reference", "pallas_tpu", "pallas_tpu_interpret")

# Race detection off: it slows the interpreter, and the kernel's own tests run with it on.
TPU_INTERPRET_PARAMS = pltpu.InterpretParams(detect_races=False)


def grouped_matmul_reference(
    lhs: jax.Array, rhs: jax.Array | Mxfp4Weight, group_sizes: jax.Array, rhs_scale: jax.Array | None = None
) -> jax.Array:
    """``lhs [M, K]``, ``rhs [G, K, N]``, ``group_sizes [G]`` int32 -> ``[M, N]`` in lhs.dtype.

    ``rhs_scale``: f32 ``[G, 1, N]`` per-output-channel scales of a quantized ``rhs`` (int8 or
    float8_e4m3fn): the weight is ``rhs * rhs_scale``. An ``Mxfp4Weight`` ``rhs`` (``packed`` u8
    ``[G, K/2, N]``, ``scale`` e8m0 ``[G, K/32, N]``) is ``quant.fp4.dequantize_mxfp4(rhs)``, the
    repo's tested decoder, so the kernel's in-VMEM decode is checked against it.

    Row ``r`` of group ``g`` (``start_g <= r < start_g + group_sizes[g]``, starts the exclusive
    cumulative sum) is ``lhs[r] @ rhs[g]``, in f32 at HIGHEST precision; rows at or past
    ``sum(group_sizes)`` (which must be <= M) are zero. One full ``[M, K] @ [K, N]`` per group,
    each row kept from its own group's: simple, not fast.
    """
    m = lhs.shape[0]
    if isinstance(rhs, Mxfp4Weight):
        if rhs_scale is not None:
            raise ValueError("grouped_matmul_reference: an MXFP4 rhs carries its own scales")
        rhs = dequantize_mxfp4(rhs).reshape(*rhs.packed.shape[:-2], rhs.in_features, rhs.out_features)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row = jnp.arange(m, dtype=jnp.int32)
    # group of each row: how many groups end at or before it (G for rows past the sum)
    row_group = jnp.sum(row[:, None] >= ends[None, :], axis=1)
    x = lhs.astype(jnp.float32)

    scales = jnp.ones((rhs.shape[0], 1, rhs.shape[2]), jnp.float32) if rhs_scale is None else rhs_scale

    def one_group(acc, gws):
        g, w, s = gws
        y = jnp.dot(x, w.astype(jnp.float32) * s, precision=lax.Precision.HIGHEST)
        return jnp.where((row_group == g)[:, None], y, acc), None

    init = jnp.zeros((m, rhs.shape[2]), jnp.float32)
    out, _ = lax.scan(one_group, init, (jnp.arange(rhs.shape[0], dtype=jnp.int32), rhs, scales))
    return out.astype(lhs.dtype)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array | Mxfp4Weight,
    group_sizes: jax.Array,
    rhs_scale: jax.Array | None = None,
    layer: jax.Array | None = None,
    *,
    impl: str = "reference",
    tiling: tuple[int, int, int] | None = None,
    interpret=None,
) -> jax.Array:
    """``lhs [M, K]`` @ per-group ``rhs [G, K, N]`` -> ``[M, N]`` (contract: the reference above).

    impl: "reference" (jnp, any backend), "pallas_tpu" (the compiled kernel, TPU only) or
    "pallas_tpu_interpret" (the same kernel in TPU interpret mode on any backend; ``interpret``
    overrides its ``pltpu.InterpretParams``). ``tiling`` = (tm, tk, tn) for the kernel.
    ``rhs_scale``: per-output-channel scales of an 8-bit ``rhs`` (see the reference); or ``rhs``
    an ``Mxfp4Weight`` with ``packed [G, K/2, N]``, ``scale [G, K/32, N]``.
    ``layer``: a scalar int32 when ``rhs`` (and ``rhs_scale``) hold every layer's experts,
    ``[L, G, K, N]`` (MXFP4: ``[L, G, K/2, N]``, ``[L, G, K/32, N]``): layer ``layer``'s are used
    (the kernel reads them in place).
    """
    if impl == "reference":
        if layer is not None:
            rhs = jax.tree_util.tree_map(lambda a: a[layer], rhs)  # an array or the record's arrays
            rhs_scale = None if rhs_scale is None else rhs_scale[layer]
        return grouped_matmul_reference(lhs, rhs, group_sizes, rhs_scale)
    if impl == "pallas_tpu":
        return grouped_matmul_tpu(lhs, rhs, group_sizes, rhs_scale, layer, tiling=tiling)
    if impl == "pallas_tpu_interpret":
        params = interpret or TPU_INTERPRET_PARAMS
        return grouped_matmul_tpu(lhs, rhs, group_sizes, rhs_scale, layer, tiling=tiling, interpret=params)
    raise ValueError(f"grouped_matmul: impl {impl!r} is not one of {IMPLS}")

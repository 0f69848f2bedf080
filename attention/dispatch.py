"""The one attention entry point the models call; picks the implementation per backend."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from tpuserve.attention.blocked import ragged_paged_attention_blocked

# resolve_impl and kv_cache_shape live in a jax-free module (KV sizing needs them before jax);
# re-exported here, next to the entry point that uses the shapes.
from tpuserve.attention.kv_cache_shape import (  # noqa: F401
    PADDED_HEAD_IMPLS,
    combined_heads,
    kv_cache_shape,
    lane_packed_rows,
    resolve_impl,
)
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.attention.names import ATTENTION_IMPLS
from tpuserve.attention.pallas_gpu import ragged_paged_attention_gpu_stacked
from tpuserve.attention.pallas_tpu import ragged_paged_attention_tpu_stacked
from tpuserve.attention.reference import ragged_paged_attention_ref, write_kv_ref

# "pallas_tpu_interpret" runs the real TPU kernel on CPU in TPU interpret mode (simulated HBM/VMEM/
# SMEM, DMAs executed on wait, semaphores, uninitialised VMEM reading as NaN). Race detection is
# off here: it costs ~35% more interpret time per call, and the kernel's own tests
# (tests/attention/test_pallas_tpu.py) already run every case with detect_races=True.
TPU_INTERPRET_PARAMS = pltpu.InterpretParams(detect_races=False)


@dataclass(frozen=True)
class AttentionParams:
    """Static per-model attention settings (hashable, so they can live in a jit closure)."""

    sm_scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None
    # The cache holds k / k_scale and v / v_scale (an FP8 KV cache); attention multiplies back.
    k_scale: float | None = None
    v_scale: float | None = None
    # The cached values' dtype name when the cache holds their bytes as uint8 (an FP8 cache as
    # the engine stores it on CPU and TPU, kv_cache_shape.kv_storage_dtype); None: the values are
    # the cache's own dtype.
    kv_dtype: str | None = None


def interleave_kv(k, v):
    """[T, Hkv, D] K and V -> [T, 2*Hkv, D] in the cache's order: combined head 2h is K of KV head h,
    2h + 1 its V (kv_cache/layout.py)."""
    t, h, d = k.shape
    return jnp.stack([k, v], axis=2).reshape(t, 2 * h, d)


def split_kv(kv, num_kv_heads: int | None = None, head_dim: int | None = None):
    """[..., C, D] -> (K, V), each [..., Hkv, D]; pass ``num_kv_heads`` when C carries padding.
    ``head_dim``: the model's; a cache whose minor dim is twice it is lane-packed (row h = K_h | V_h,
    ``kv_cache_shape.lane_packed``), split on its lanes (padding rows come along without
    ``num_kv_heads``)."""
    if head_dim is not None and kv.shape[-1] == 2 * head_dim:
        if num_kv_heads is not None:
            kv = kv[..., :num_kv_heads, :]
        return kv[..., :head_dim], kv[..., head_dim:]
    if num_kv_heads is not None:
        kv = kv[..., : 2 * num_kv_heads, :]
    return kv[..., 0::2, :], kv[..., 1::2, :]


def quantize_kv(new_k: jax.Array, new_v: jax.Array, params: AttentionParams, cache_dtype):
    """This step's K/V [T, Hkv, D] as the cache stores them: [T, 2*Hkv, D] interleaved, divided by
    the scales (in f32), clipped to the cache dtype's finite range when it is an FP8 type and cast.

    The clip matters: jax's cast of an out-of-range value to ``float8_e4m3fn`` (no inf) gives NaN,
    where a saturating cast (torch's) gives +-448; a NaN in the cache would poison every query that
    reads the page.
    """
    k, v = new_k, new_v
    fp8 = jnp.issubdtype(cache_dtype, jnp.floating) and jnp.dtype(cache_dtype).itemsize == 1
    if params.k_scale is not None or params.v_scale is not None or fp8:
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        if params.k_scale is not None:
            k = k / params.k_scale
        if params.v_scale is not None:
            v = v / params.v_scale
        if fp8:
            limit = float(jnp.finfo(cache_dtype).max)
            k, v = jnp.clip(k, -limit, limit), jnp.clip(v, -limit, limit)
    return interleave_kv(k, v).astype(cache_dtype)


def ragged_paged_attention(
    queries: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    md: AttentionMetadata,
    params: AttentionParams,
    impl: str,
    mesh=None,
    heads_axis: str | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Write this step's K/V into layer ``layer`` of the stacked cache, then attend.

    mesh, heads_axis: under tensor parallelism the heads and the cache's combined-head axis are
    split over the mesh axis named ``heads_axis`` (the caller owns the mesh and its axis names);
    each device then runs ``impl`` on its own heads (``shard_map``: a Pallas kernel cannot be
    partitioned by XLA) and no data crosses devices. No mesh, or an axis of size 1: one device.

    queries [T, Hq, D]; new_k, new_v [T, Hkv, D]; kv_cache [L, P, page_size, C, D] in the
    shape ``kv_cache_shape(impl, spec)`` gives (C = 2*Hkv, or padded to the sublane tile for the
    Pallas TPU kernel, which also takes an unpadded cache); layer: scalar int32.
    The write goes through ``quantize_kv``: with ``params.k_scale`` / ``v_scale`` the cache holds
    K / k_scale and V / v_scale, clipped and cast when it is an FP8 cache.
    sinks: None, or f32 [Hq] attention-sink logits of this layer (gpt-oss), in the queries' head
    order: each query row's softmax denominator gains exp(sink of its head), a key with no value
    (not scaled by sm_scale, not soft-capped). A traced array; None leaves the program as without.
    Under tensor parallelism they split over ``heads_axis`` like the query heads.
    Returns (out [T, Hq, D], updated kv_cache).
    """
    if mesh is not None and heads_axis is None:
        raise ValueError(
            "ragged_paged_attention: a mesh needs heads_axis, the mesh axis the heads split over"
        )
    if mesh is not None and mesh.shape[heads_axis] > 1:
        heads, cache = P(None, heads_axis, None), P(None, None, None, heads_axis, None)

        def local(q, k, v, kv, layer, md, *sinks):
            return _attend(q, k, v, kv, layer, md, params, impl, *sinks)

        # The sinks (if any) split like the query heads: a device's rows meet their own heads' sinks.
        sink_args, sink_specs = ((), ()) if sinks is None else ((sinks,), (P(heads_axis),))
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(heads, heads, heads, cache, P(), P(), *sink_specs),
            out_specs=(heads, cache),
            check_vma=False,
        )(queries, new_k, new_v, kv_cache, layer, md, *sink_args)
    return _attend(queries, new_k, new_v, kv_cache, layer, md, params, impl, sinks)


def _attend(
    queries,
    new_k,
    new_v,
    kv_cache,
    layer,
    md: AttentionMetadata,
    params: AttentionParams,
    impl: str,
    sinks: jax.Array | None = None,
):
    values = jnp.dtype(params.kv_dtype or kv_cache.dtype)  # what the cache holds (its bytes, if uint8)
    as_bytes = values != kv_cache.dtype
    if as_bytes and (kv_cache.dtype != jnp.uint8 or values.itemsize != 1):
        raise ValueError(f"a {kv_cache.dtype} KV cache cannot hold {values.name} values")
    if impl == "auto":
        # Resolved once, where the engine's config meets its platform (EngineConfig.with_modes_resolved).
        raise ValueError(
            "ragged_paged_attention needs a concrete impl; resolve 'auto' with resolve_impl first"
        )
    num_combined = 2 * new_k.shape[1]
    cache_heads = kv_cache.shape[-2]
    # Only the TPU kernel knows padding heads; the others read C as 2*Hkv and would misplace heads.
    allowed: tuple[int, ...] = (num_combined, combined_heads(impl, new_k.shape[1], kv_cache.dtype))
    if impl in PADDED_HEAD_IMPLS and kv_cache.shape[-1] == 2 * new_k.shape[-1]:
        allowed = (lane_packed_rows(new_k.shape[1]),)  # lane-packed: a row per KV head, padded
    if cache_heads not in allowed:
        raise ValueError(
            f"attention impl {impl!r} needs the KV cache's combined-head axis to be "
            f"one of {sorted(set(allowed))} (see kv_cache_shape), got "
            f"{kv_cache.shape}"
        )
    if impl in ("reference", "blocked"):
        # In place on the stacked cache: slicing a layer out and back would copy it twice a step.
        new_kv = quantize_kv(new_k, new_v, params, values)
        kv_cache = write_kv_ref(
            kv_cache, new_kv, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs, layer=layer
        )
        attend = ragged_paged_attention_ref if impl == "reference" else ragged_paged_attention_blocked
        out = attend(
            queries,
            kv_cache,
            md.kv_lens,
            md.page_indices,
            md.cu_q_lens,
            md.num_seqs,
            sm_scale=params.sm_scale,
            sliding_window=params.sliding_window,
            soft_cap=params.soft_cap,
            k_scale=params.k_scale,
            v_scale=params.v_scale,
            layer=layer,
            kv_dtype=values,
            sinks=sinks,
        )
        return out, kv_cache
    if as_bytes and impl not in PADDED_HEAD_IMPLS:
        raise ValueError(
            f"attention impl {impl!r} reads a KV cache in its own dtype, not {values.name} values "
            f"stored as uint8 bytes (the engine's FP8 cache on CPU and TPU); the jnp paths "
            f"(reference, blocked) and the TPU kernel read those"
        )
    # The kernels write the layer in place: the layer index travels as a scalar, no slicing.
    new_kv = quantize_kv(new_k, new_v, params, values)
    args = (queries, new_kv, kv_cache, layer, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs)
    kwargs = dict(
        sm_scale=params.sm_scale,
        sliding_window=params.sliding_window,
        soft_cap=params.soft_cap,
        k_scale=params.k_scale,
        v_scale=params.v_scale,
        sinks=sinks,
    )
    if impl in PADDED_HEAD_IMPLS:
        # A uint8 cache of FP8 bytes: the kernel decodes the codes and writes new_kv's bytes.
        tpu = dict(num_kv_heads=new_k.shape[1], kv_dtype=values if as_bytes else None)
        if impl == "pallas_tpu_interpret":
            tpu["interpret"] = TPU_INTERPRET_PARAMS
        return ragged_paged_attention_tpu_stacked(*args, **tpu, **kwargs)
    if impl == "pallas_gpu":
        return ragged_paged_attention_gpu_stacked(*args, **kwargs)
    raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")

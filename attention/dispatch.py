"""The one attention entry point the models call; picks the implementation per backend."""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.experimental.pallas import tpu as pltpu

from tpuserve.attention.blocked import ragged_paged_attention_blocked
from tpuserve.attention.metadata import AttentionMetadata
from tpuserve.attention.pallas_gpu import ragged_paged_attention_gpu_stacked
from tpuserve.attention.pallas_tpu import ragged_paged_attention_tpu_stacked
from tpuserve.attention.reference import ragged_paged_attention_ref, write_kv_ref
from tpuserve.kv_cache.layout import interleave_kv

ATTENTION_IMPLS = ("auto", "reference", "blocked", "pallas_tpu", "pallas_tpu_interpret", "pallas_gpu")

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
    k_scale: float | None = None
    v_scale: float | None = None


def resolve_impl(impl: str, backend: str) -> str:
    """Turn ``auto`` into a concrete implementation for a JAX backend ('tpu', 'gpu', 'cpu')."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    # CPU (and anything else) runs the blocked jnp path: the reference's whole-row gather costs
    # 2-7x more there (attention/blocked.py says why).
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, "blocked")


def ragged_paged_attention(
    queries: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    md: AttentionMetadata,
    params: AttentionParams,
    impl: str,
) -> tuple[jax.Array, jax.Array]:
    """Write this step's K/V into layer ``layer`` of the stacked cache, then attend.

    queries [T, Hq, D]; new_k, new_v [T, Hkv, D]; kv_cache [L, P, page_size, 2*Hkv, D];
    layer: scalar int32. Returns (out [T, Hq, D], updated kv_cache).
    """
    if impl == "auto":
        impl = resolve_impl(impl, jax.default_backend())
    if impl in ("reference", "blocked"):
        # In place on the stacked cache: slicing a layer out and back would copy it twice a step.
        kv_cache = write_kv_ref(kv_cache, interleave_kv(new_k, new_v), md.kv_lens, md.page_indices,
                                md.cu_q_lens, md.num_seqs, layer=layer)
        attend = ragged_paged_attention_ref if impl == "reference" else ragged_paged_attention_blocked
        out = attend(
            queries, kv_cache, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=params.sm_scale, sliding_window=params.sliding_window,
            soft_cap=params.soft_cap, k_scale=params.k_scale, v_scale=params.v_scale, layer=layer)
        return out, kv_cache
    # The kernels write the layer in place: the layer index travels as a scalar, no slicing.
    new_kv = interleave_kv(new_k, new_v)
    args = (queries, new_kv, kv_cache, layer, md.kv_lens, md.page_indices, md.cu_q_lens,
            md.num_seqs)
    kwargs = dict(sm_scale=params.sm_scale, sliding_window=params.sliding_window,
                  soft_cap=params.soft_cap, k_scale=params.k_scale, v_scale=params.v_scale)
    if impl == "pallas_tpu":
        return ragged_paged_attention_tpu_stacked(*args, **kwargs)
    if impl == "pallas_tpu_interpret":
        return ragged_paged_attention_tpu_stacked(*args, interpret=TPU_INTERPRET_PARAMS, **kwargs)
    if impl == "pallas_gpu":
        return ragged_paged_attention_gpu_stacked(*args, **kwargs)
    raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")

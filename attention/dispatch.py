"""The one attention entry point the models call; picks the implementation per backend."""

from __future__ import annotations

from dataclasses import dataclass

import jax

from attention.metadata import AttentionMetadata
from attention.reference import ragged_paged_attention_ref, write_kv_ref
from kv_cache.layout import interleave_kv

ATTENTION_IMPLS = ("auto", "reference", "pallas_tpu", "pallas_tpu_interpret", "pallas_gpu")


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
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, "reference")


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
    if impl == "reference":
        new_kv = interleave_kv(new_k, new_v)
        layer_pages = write_kv_ref(kv_cache[layer], new_kv, md.kv_lens, md.page_indices,
                                   md.cu_q_lens, md.num_seqs)
        kv_cache = jax.lax.dynamic_update_index_in_dim(kv_cache, layer_pages, layer, 0)
        out = ragged_paged_attention_ref(
            queries, layer_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=params.sm_scale, sliding_window=params.sliding_window,
            soft_cap=params.soft_cap, k_scale=params.k_scale, v_scale=params.v_scale)
        return out, kv_cache
    raise NotImplementedError(f"attention_impl={impl!r} is not available yet")

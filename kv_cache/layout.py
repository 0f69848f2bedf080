"""The one KV cache layout shared by attention kernels, the block pool and (later) offload/transfer.

Per layer, K and V of ``page_size`` consecutive tokens of one sequence live in one *page*:

    kv_pages: [num_pages, page_size, 2 * num_kv_heads, head_dim]

with K and V *interleaved* along the combined-head axis: combined head ``2*h`` is K of KV head
``h`` and ``2*h + 1`` is V of KV head ``h``. One DMA of a page slice therefore fetches K and V
together, which is what the Pallas kernel wants, and it is the layout of jax's own
``ref_ragged_paged_attention`` so that function can serve as an independent oracle.

The model keeps all layers in one array, ``[num_layers, num_pages, page_size, 2*Hkv, D]``, so a
``lax.scan`` over layers can carry it. Page 0 is never handed to a sequence: padded page-table
entries point at it, so stray reads of padding are harmless.

A sequence's token at position ``p`` sits in page ``page_table[p // page_size]`` at row
``p % page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

RESERVED_PAGE = 0


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: jnp.dtype

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_pages, self.page_size, 2 * self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page takes across all layers (K and V)."""
        return (self.num_layers * self.page_size * 2 * self.num_kv_heads * self.head_dim
                * jnp.dtype(self.dtype).itemsize)

    def allocate(self):
        return jnp.zeros(self.shape, self.dtype)


def interleave_kv(k, v):
    """[T, Hkv, D] K and V -> [T, 2*Hkv, D] in the interleaved cache order."""
    t, h, d = k.shape
    return jnp.stack([k, v], axis=2).reshape(t, 2 * h, d)


def split_kv(kv):
    """[..., 2*Hkv, D] -> (K, V), each [..., Hkv, D]."""
    return kv[..., 0::2, :], kv[..., 1::2, :]

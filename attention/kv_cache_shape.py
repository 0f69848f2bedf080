"""Which KV cache shape each attention implementation wants (no jax import: sizing code uses it).

``resolve_impl`` (``auto`` -> a concrete impl per backend) lives here for the same reason;
``attention/dispatch.py`` re-exports both.

Every implementation stores a layer's page as ``[page_size, C, D]`` with K and V interleaved on the
combined-head axis C (kv_cache/layout.py). C is ``2*Hkv`` for all implementations except the
Pallas TPU kernel's, which pads C up to a multiple of the TPU sublane tile of the cache dtype:

    32-bit -> 8,  16-bit (bf16, f16) -> 16,  8-bit (fp8, int8) -> 32

Why: on a TPU the last two dims of an array are tiled (sublanes x 128 lanes), and a ``[C, D]``
slice with C below the tile occupies a whole tile anyway. Padding C makes that waste explicit (and
counted in the KV sizing), and it lets the kernel view a page as ``[page_size*C, D]`` for free - a
bitcast, where an unpadded small C makes XLA relayout the whole cache around every call. Combined
heads ``>= 2*Hkv`` are padding: never written, never read into the attention math, zero forever.

What that costs an FP8 cache (``page_bytes``; the memory plan counts it): a token row takes
``C x 128-lane rows x itemsize`` bytes a layer. With 2*Hkv <= 16 per device, bf16 pads to 16 rows
of 2 bytes and fp8 to 32 rows of 1 byte: the same bytes. Llama-3.2-1B (8 KV heads, head_dim 64 in
128 lanes) in this padded layout: 4,096 B a token a layer in bf16 and in fp8 (payload 2,048 and
1,024); it is lane-packed instead (below: 2,048 B bf16, 1,024 B fp8). Llama-3-8B (8 KV
heads, d 128): 4,096 both. Only 2*Hkv > 16 per device gains (2x at 16 KV heads). Follow-up for a
dense 8-bit layout: two token rows of 16 combined heads sharing one 32-row tile - the cache as
``[L, P, page_size / 2, 32, D]`` (or 4-D ``[L, P, page_size*C, D]``), whose 2-D view is the same
free bitcast; the kernel's loads work on it unchanged (stride C/4 words), but a token's write is
half a tile, which Mosaic cannot DMA into HBM (a read-modify-write of the tile, or the write left
to an in-place XLA scatter outside the kernel), and every consumer of the 5-D page shape (write_kv_ref,
the page movers, host tier, P/D transfer between impls) must take the new shape.

Lane-packed (the TPU kernel, head_dim 64, any cache width: ``lane_packed``): a page is
``[page_size, C, 128]`` with row h = ``[K_h | V_h]`` and C = Hkv rounded up to 8 per shard
(``lane_packed_rows``), so head_dim 64 no longer leaves half of every 128-lane row empty: 2,048 B a
token a layer at the 1B shape in bf16 and 1,024 B in fp8 (eight 1-byte rows: one (8, 128) tile of 4-row words), its
payload. Measured on a v5e (benchmarks/RESULTS.md, 2026-12-07): a b128 x 1024 decode step's
attention 792 -> 516 us (bf16).
"""

from __future__ import annotations

import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 names with numpy)
import numpy as np

from tpuserve.attention.names import ATTENTION_IMPLS

# Implementations whose cache pads the combined-head axis to the sublane tile.
PADDED_HEAD_IMPLS = ("pallas_tpu", "pallas_tpu_interpret")
# Lanes of a TPU tile: the minor dim of an array in TPU memory is stored in multiples of this.
TPU_LANES = 128


# Bytes of SMEM the Pallas TPU kernel's page table may take. The kernel prefetches the whole table
# (max_num_seqs x pages per sequence int32) into SMEM, 1 MiB on a v5e, beside its other scalars: on
# the chip a 512 KiB table compiled (8,192 tokens of 16-token pages x 256 sequences) and a 2.5 MiB
# one (40,960 tokens) failed with RESOURCE_EXHAUSTED.
PAGE_TABLE_SMEM_BYTES = 512 * 1024


def min_page_size(impl: str, max_model_len: int, max_num_seqs: int) -> int:
    """The smallest power-of-two page size whose page table fits ``impl``'s budget (1: no limit).

    Only the Pallas TPU kernel (and its interpret mode, so CPU tests take the same decision) holds
    the table in SMEM; longer contexts there need bigger pages, as vLLM's TPU backend does."""
    if impl not in PADDED_HEAD_IMPLS:
        return 1
    max_pages = max(1, PAGE_TABLE_SMEM_BYTES // (4 * max_num_seqs))
    need = -(-max_model_len // max_pages)
    return 1 << max(0, (need - 1).bit_length())


def resolve_impl(impl: str, backend: str, kv_cache_dtype=None) -> str:
    """Turn ``auto`` into a concrete implementation for a JAX backend ('tpu', 'gpu', 'cpu').

    The compiled TPU kernel reads float32, bfloat16 and 1-byte FP8 caches (float8_e4m3fn /
    float8_e5m2 codes, decoded in VMEM), so ``auto`` is ``pallas_tpu`` on a TPU for every cache
    dtype the engine offers."""
    byte_cache = kv_cache_dtype is not None and np.dtype(kv_cache_dtype).itemsize == 1
    name = np.dtype(kv_cache_dtype).name if byte_cache else ""
    return resolve_attention_impl(impl, backend, byte_cache, name)


def resolve_attention_impl(impl: str, backend: str, byte_cache: bool, cache_dtype_name: str = "fp8") -> str:
    """``resolve_impl`` knowing only whether the cache holds 1-byte values (the engine config
    resolves its mode before any dtype exists).

    A 1-byte (FP8) cache on a TPU runs the compiled kernel, which decodes its codes in VMEM. The
    jnp reference, asked for by name, still runs one too, but it is no default there: with the
    cache stored as fp8 its step on a v5e needed 56.8 GB of HLO temporaries for a 1B model at
    gpu_memory_utilization 0.9 (XLA widened the whole cache); with today's uint8 storage
    (``kv_storage_dtype``) it gathers bytes as on CPU, not yet measured on a TPU."""
    del byte_cache, cache_dtype_name  # every cache dtype the engine offers has a TPU path now
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    # CPU (and anything else) runs the blocked jnp path: the reference's whole-row gather costs
    # 2-7x more there (attention/blocked.py says why).
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, "blocked")


def kv_storage_dtype(dtype, backend: str) -> np.dtype:
    """The dtype a KV cache of ``dtype`` values is stored in on ``backend``.

    An FP8 cache is stored as uint8 (the same bytes) on CPU and TPU. XLA:CPU widens the whole
    operand of an fp8 gather or scatter, so every layer of every step copied the entire cache
    (bitcasting the whole cache to uint8 inside the step copied it too); as uint8 it is read and
    written in place, and only the rows a step reads or writes are bitcast. On a TPU the compiled
    kernel reads the bytes as 32-bit words and decodes the codes with integer ops (no fp8 vector
    type: a v5e has none), the jnp reference gathers bytes as on CPU, and interpret-mode tests run
    the very storage the chip does. Elsewhere (the GPU kernel reads fp8 itself) the cache stays
    in its own dtype."""
    dtype = np.dtype(dtype)
    byte_float = dtype.itemsize == 1 and dtype.kind not in "biu"  # ml_dtypes' float8 types
    return np.dtype(np.uint8) if byte_float and backend in ("cpu", "tpu") else dtype


def sublane_tile(dtype) -> int:
    """Rows of one TPU (sublane x lane) tile of ``dtype``: 8 of 32 bits, more when packed."""
    itemsize = np.dtype(dtype).itemsize
    return 8 * max(1, 4 // itemsize)


def padded_combined_heads(num_kv_heads: int, dtype) -> int:
    """``2*num_kv_heads`` rounded up to a multiple of the sublane tile of ``dtype``."""
    tile = sublane_tile(dtype)
    return -(-2 * num_kv_heads // tile) * tile


def combined_heads(impl: str, num_kv_heads: int, dtype) -> int:
    """Size of the combined-head axis of ``impl``'s cache (a concrete impl, not ``auto``)."""
    if impl == "auto" or impl not in ATTENTION_IMPLS:
        raise ValueError(
            f"need a concrete attention impl (turn 'auto' into one with "
            f"resolve_impl first), one of {ATTENTION_IMPLS[1:]}, got {impl!r}"
        )
    if impl in PADDED_HEAD_IMPLS:
        return padded_combined_heads(num_kv_heads, dtype)
    return 2 * num_kv_heads


def lane_packed_rows(num_kv_heads: int) -> int:
    """Rows C of a lane-packed page (``pallas_tpu.pack_kv_lanes``: row h of a token holds
    ``[K_h | V_h]``, head_dim 64 in 128 lanes): Hkv rounded up to 8. XLA:TPU tiles a
    ``[.., 8, 128]`` bf16 or f32 array in one (8, 128) tile (read on a v5e, 2026-12-07:
    ``benchmarks/tpu_layout_probe.py``), so a token's write is one whole tile and the page's
    2-D view a free reshape, at half the bytes of the padded ``[16, 128]`` rows."""
    return -(-num_kv_heads // 8) * 8


def device_head_dim(impl: str, head_dim: int) -> int:
    """Elements one cache row of ``head_dim`` really takes in device memory. The compiled TPU kernel
    needs the cache row-major (``kv_cache_format``), where a TPU stores the minor dim in whole
    128-lane tiles: head_dim 64 takes 128. Other implementations store rows as they are."""
    if impl == "pallas_tpu":
        return -(-head_dim // TPU_LANES) * TPU_LANES
    return head_dim


def tpu_tiling(dtype) -> tuple[tuple[int, int], ...]:
    """XLA's tiling of an array of ``dtype`` in TPU memory: (8, 128) tiles of 32-bit words, and
    narrower types packed 32 // bits rows to a word (bf16 ((8, 128), (2, 1)), as read from
    ``jax.Array.format`` on a v5e)."""
    bits = np.dtype(dtype).itemsize * 8
    return ((8, TPU_LANES),) if bits >= 32 else ((8, TPU_LANES), (32 // bits, 1))


def kv_cache_shape(impl: str, spec) -> tuple[int, int, int, int, int]:
    """``[L, P, page_size, C, D]`` of the stacked cache ``impl`` works on, for a ``KVCacheSpec``.

    The TPU kernel's cache of a head_dim-64 model is lane-packed (``lane_packed``): C rows of
    ``[K_h | V_h]``, D = 128, half the bytes of the padded interleaved layout.

    A cache split by KV head over ``spec.num_shards`` devices (tensor parallel) is the concatenation
    of each device's own cache on C, so padding (if ``impl`` pads) applies per shard.
    """
    shards = getattr(spec, "num_shards", 1)
    if lane_packed(impl, spec.head_dim):
        rows = lane_packed_rows(spec.num_kv_heads // shards)
        return (spec.num_layers, spec.num_pages, spec.page_size, shards * rows, 2 * spec.head_dim)
    per_shard = combined_heads(impl, spec.num_kv_heads // shards, spec.dtype)
    return (spec.num_layers, spec.num_pages, spec.page_size, shards * per_shard, spec.head_dim)


def lane_packed(impl: str, head_dim: int) -> bool:
    """Whether ``impl``'s cache is lane-packed (``lane_packed_rows``): the TPU kernel's, for
    head_dim 64 (K | V fill one 128-lane row), at every cache width the kernel reads (a 1-byte
    cache four heads' codes a 32-bit word; all compiled on a v5e, benchmarks/RESULTS.md)."""
    return impl in PADDED_HEAD_IMPLS and 2 * head_dim == TPU_LANES

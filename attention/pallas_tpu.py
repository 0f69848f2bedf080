"""Pallas TPU ragged paged attention: one kernel for decode, prefill and mixed batches.

Semantics are those of ``attention/reference.py`` (``write_kv_ref`` followed by
``ragged_paged_attention_ref``): this step's K/V are written into the paged cache, then every query
token attends causally to its sequence's cache (optionally within a sliding window, with a logit
soft cap and FP8 K/V scales). Padding tokens (past ``cu_q_lens[num_seqs]``) produce zeros.

KV layout (kv_cache/layout.py, attention/kv_cache_shape.py)
-----------------------------------------------------------
The kernel works on the model's stacked cache ``[L, P, page_size, C, D]``; the layer is a
scalar-prefetch operand, so one layer is updated in place without slicing it out. K and V are
interleaved on the combined-head axis (``2*h`` = K of KV head h, ``2*h+1`` = V), so one DMA of a
page brings K and V of every head. The kernel sees the cache as ``[L, P, page_size*C, D]``
(row ``r*C + c`` = token row r, combined head c): a reshape that is free (a bitcast) only when C
is a multiple of the sublane tile (8 rows for 32-bit, 16 for bf16/f16, 32 for fp8). So the cache
this kernel is given (``kv_cache_shape("pallas_tpu", spec)``) pads C from 2*Hkv up to that
multiple: heads ``2*Hkv .. C-1`` are padding, zero from allocation. The padded ``[page_size, C, D]``
page takes the same HBM tiles the unpadded one would, since a TPU tiles the last two dims anyway.
An unpadded cache (C = 2*Hkv) still works: correct, but below the tile XLA relayouts the cache
around every call. The real head count comes from ``new_kv`` (or ``num_kv_heads``), never from C.
Padding heads never enter the math: they ride along in the page DMA (one contiguous copy per
page) but the strided loads below only touch real heads. A token's write covers its whole row
``r*C .. r*C + C - 1``, padding heads written as zero: Mosaic slices HBM only in whole sublane
tiles, so a write of just the 2*Hkv real heads (6 for a 3-KV-head model) does not compile on a TPU.
In the 2-D view K of head h for a KV block is one sublane-strided load
(``pl.ds(2*h, kv_block, stride=C)``), the pattern jax's own TPU kernel uses; for bf16 the compiled
kernel strides a uint32 view instead (``_load_kv_head``).

Lane-packed cache (head_dim 64: ``pack_kv_lanes``, ``kv_cache_shape.lane_packed``): a cache whose
minor dim is twice the queries' holds row h = ``[K_h | V_h]`` (C = Hkv rounded up to 8), half the
bytes of padding 64 to 128 lanes. The queries are zero-padded to 128 lanes, so ``q . [K | V]`` is
``q . K``, and ``p @ [K | V]`` carries ``p . V`` in its upper 64 lanes, which the wrapper returns:
no lane slicing inside the kernel. bf16 words hold heads 2w / 2w + 1, FP8 words heads 4w .. 4w + 3.
On a v5e (1B heads) a b128 x 1024 decode step took 516 us against 792 padded.

FP8 cache: 1-byte float8_e4m3fn / float8_e5m2 codes, stored as uint8 by the engine
(``kv_storage_dtype``, ``kv_dtype=`` here; a float8-typed cache works too). Pages move by the same
DMAs; the new rows arrive quantized (``quantize_kv``) and are DMA'd as bytes. Reads stride the
buffer's uint32 view: a word holds combined heads 4w .. 4w+3 of a token, so K and V of head h are
bytes ``2*(h % 2)`` and ``2*(h % 2) + 1`` of word ``h // 2``, extracted with shifts and decoded to
f32 with 32-bit integer ops (``_fp8_to_f32``: no fp8 vector type, which a v5e has no unit for),
then cast to the query dtype (exact: every fp8 value is a bf16). C is padded to 32 for 8-bit (the
tile of 32 byte rows), so with up to 8 KV heads a token's row takes as many bytes as bf16's 16
rows: the FP8 cache then saves no HBM or DMA bytes, only from 16 KV heads (per device) on (see
``kv_cache_shape``). At head_dim 64 the FP8 cache is lane-packed like bf16's (1 KiB a token a
layer at the 1B shape, half of bf16's; checked compiled on a v5e, 2026-12-07), though its decode
step is slower than bf16's (b128 x 1024: 853 vs 508 us): decoding the bytes costs VPU work.

Queries are re-laid out outside the kernel (cheap next to the KV traffic) from ``[T, Hq, D]`` to
``[NB, Hkv, bq*G, D]`` (NB query blocks of ``bq`` tokens, G = Hq/Hkv): row ``t*G + g`` of KV head
h is query head ``h*G + g`` of token ``blk*bq + t``. One matmul per KV head then serves the whole
GQA group (M = bq*G rows), and the block's last two dims are full array dims, so any bq is legal.

Algorithm
---------
grid = (NB,) over query blocks, "arbitrary" (sequential) because DMAs cross grid steps.

* Scalar prefetch (SMEM): layer, kv_lens[S], page_indices flattened to [S*pages_per_seq] (a 2-D
  SMEM array would be padded), cu_q_lens[S+1], num_seqs[1], and first_seq[NB] (the sequence that
  owns each block's first token, found with ``searchsorted`` outside the kernel).
* Step 0 prologue - KV write: every real token's ``new_kv[t]`` row (``[2*Hkv, D]``) is DMA'd
  HBM -> HBM into the real heads of ``cache[layer, page, row]`` (at most
  ``_MAX_WRITES_IN_FLIGHT`` outstanding on one DMA semaphore), and all writes complete before the
  first KV read is issued, so every query sees its own chunk's K/V and no read races a write.
  Writes are not overlapped with compute (the cost is one ``[2*Hkv, D]`` row per token, small next
  to the reads).
* A block's work is a list of (sequence, KV block) items: each sequence owning rows of the block,
  and for it the KV blocks of ``pages_per_block`` pages that its rows can see - blocks entirely
  after the last row (causal) or entirely before the sliding window of the first row are skipped.
* Double buffering: ``kv_buf[2, pages_per_block*page_size*C, D]`` in VMEM, one DMA semaphore
  per slot, one DMA per page. Each item starts the next item's pages into the other slot - across
  sequences and across grid steps (the last item of step i prefetches step i+1's first block; the
  slot it used is kept in SMEM) - then waits for its own slot and computes, so two blocks' DMAs can
  be in flight while the scalar core issues the next. Only pages below
  ``kv_len`` are fetched; the rest of the slot is stale (or NaN in interpret mode), so V rows past
  ``kv_len`` are zeroed and scores are masked with ``where`` (never multiplied) before use.
* An item whose rows all belong to its sequence and all see its whole KV block (a long prompt's
  blocks before the diagonal) skips the mask: no iota compares or ``where`` per score
  (``_sees_whole_kv_block``). Measured on a v5e it saved ~1% of a long chunk (1912 -> 1894 us at
  8k context); the item count (1024-token KV blocks) was what mattered there.
* Online softmax per KV head in f32 VMEM scratch (m, l: [Hkv, bq*G, 1]; acc: [Hkv, bq*G, D]).
  Rows of other sequences in the block are masked out of an item, which leaves their running
  state untouched (their max stays, their p is 0). ``m`` starts at ``mask_value`` (finite), so
  ``exp(m_prev - m_new)`` never sees inf - inf. With attention sinks (f32 [Hq] in SMEM) each
  row starts instead at its head's sink: m = s_h, l = 1 (a key with no value). Masks are built from integer products only
  (row >= (kv_pos - base) * G) - no vector integer division, which Mosaic handles poorly.
* Scales: ``sm_scale * k_scale`` multiplies the queries before the kernel (once a step, not once
  per score of every KV block: a VPU multiply per score saved), ``v_scale`` the final output (both are
  linear), so FP8 pages are only decoded, never rescaled element-wise.

Block sizes
-----------
``num_queries_per_block`` (bq) trades MXU rows (bq*G) against wasted rows when a block holds
several short sequences; ``num_kv_pages_per_block`` sets the DMA/compute granularity and VMEM use
(2 * kv_tokens * C * D * itemsize). Defaults (``default_block_sizes``), for 16-bit caches (a
32-bit cache gets half the KV tokens, the same VMEM bytes): v5e, measured on one
(benchmarks/attention_tpu.py --sweep, end to end with tpu_e2e.py; benchmarks/RESULTS.md), 128
queries x 1024 KV tokens with 64 MiB of scoped VMEM (fewer queries for models with more than 32
query heads, fewer tokens for GQA groups above 4: ``_SCORE_ELEMS``), and 1024 KV tokens for
decode steps, where smaller blocks left half the HBM bandwidth unused; v4 /
v5p: (32, 512); v6e: 256x256 MXU, 32 MiB -> (64, 512); v7x: (64, 1024). The generations other
than v5e are reasoned from VMEM and MXU sizes, not measured. Those token counts are for rows of
16 combined heads x 128 lanes; wider rows (many KV heads; head_dim 64 also takes 128 lanes in
VMEM) get fewer tokens, so the two KV buffers stay within 8 MiB (``_KV_BUFFER_BYTES``).

Decode fast path (``single_item_decode``, on by default on v5e for 16-bit caches, as measured): with bq = 1
and a KV block as wide as the page table, every grid step is exactly one item, so the softmax is
taken at once in registers (no running max / sum / accumulator in VMEM, no item loop).

Fused-heads decode (``fused_heads``, ``_fused_decode_steps``; on by default on v5e for lane-packed
16-bit caches whose page-table bucket holds <= 256 tokens): the one-item path with every KV head of
a token in one matmul pair over the lane-packed block as it lies, a head mask on the scores, and
several tokens a grid step whose chunk chains advance together. On a v5e (1B shape, b128, 128-256
token rows) the decode-only step went 7.13 -> 5.55 ms; long rows keep the per-head loop.

Decode path: when the step has no more tokens than sequence slots (a decode or near-decode batch)
the default is bq = 1, so each grid step is one sequence with exactly G MXU rows instead of bq*G
mostly-masked ones, and the cross-step prefetch keeps the KV stream continuous - the classic
paged-decode schedule. It is the same kernel (correct for any batch), chosen statically by shape.

Status: verified on CPU in TPU interpret mode (DMAs, semaphores, race detection) against the jnp
reference and jax's ``ref_ragged_paged_attention``, and lowered to Mosaic (jaxpr -> Mosaic MLIR,
``.lower(lowering_platforms=("tpu",))``) without a TPU. The f32, bf16 and FP8 caches (padded and
lane-packed) have been compiled and run on a v5e (benchmarks/attention_tpu.py,
benchmarks/RESULTS.md). Interpret mode builds an FP8 cache's words from byte rows, so the chip's
byte order within a word (the lowest row in the low byte, as for bf16's pair) is checked there only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuserve.attention.kv_cache_shape import device_head_dim, lane_packed_rows
from tpuserve.attention.reference import sink_array

DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Outstanding KV-write DMAs on one semaphore; bounded so a long prefill never floods the DMA queue.
_MAX_WRITES_IN_FLIGHT = 8


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Per-generation defaults: queries per block and KV *tokens* per block (-> pages)."""

    num_queries_per_block: int
    kv_tokens_per_block: int
    decode_kv_tokens_per_block: int | None = None  # decode-only steps (None: kv_tokens_per_block)
    # What ``single_item_decode=None`` means on this generation (the one-item decode path).
    single_item_decode: bool = False
    # Scoped VMEM the kernel asks Mosaic for (None: Mosaic's default, 16 MiB on v5e), so blocks
    # whose softmax temporaries outgrow the default still compile.
    vmem_limit_bytes: int | None = None
    # What ``fused_heads=None`` means on this generation: the one-item decode path on a
    # lane-packed 16/32-bit cache takes every KV head of its sequence in one matmul pair
    # (``_fused_decode_steps``), over chunks of ``fused_chunk_rows`` cache rows (tokens x C),
    # ``fused_items`` tokens a grid step.
    # ``fused_heads=None`` takes it only for KV blocks (page-table buckets) of at most
    # ``fused_max_kv_tokens`` tokens: it does C times the per-head loop's score work, which long
    # rows pay for (v5e, b128 x 1024: 631-700 us against 512 per head).
    fused_head_decode: bool = False
    fused_chunk_rows: int = 1024
    fused_items: int = 4
    fused_max_kv_tokens: int = 256


_V5E = BlockSizes(
    128,
    1024,
    decode_kv_tokens_per_block=1024,
    single_item_decode=True,
    vmem_limit_bytes=64 << 20,
    fused_head_decode=True,
)
# Keys are matched as substrings of ``jax.devices()[0].device_kind`` (lower-cased).
_BLOCK_SIZES_BY_GENERATION = {
    # v5e: 128 MiB VMEM (16 MiB scoped by default), 4x 128x128 MXU. Measured on one (benchmarks/attention_tpu.py
    # --sweep, 32 q / 8 KV heads, d 128, bf16): decode reads KV at the copy bandwidth with 1024-token
    # blocks (375 GB/s at 256); a 4x512 prefill takes 2.2 ms at 64 x 512 against 3.5 at 32 x 256.
    # Fused-heads decode (1B shape end to end, 128-256-token rows, 2026-12-07, tpu_session.sh
    # fused / fused-default): b128 decode-only step 7.13 (per head) -> 6.11 (1 token a grid step)
    # -> 5.55 ms (4), TPOT 8.50 -> 7.00 ms; 8 a step 5.64 ms; b32 TPOT 4.21 -> 3.85; b1 even.
    # The one-item decode path, end to end on one (1B shape, 256-token rows, 2026-12-07): b32 step
    # 4.63 -> 4.21 ms, b128 9.74-12.58 -> 8.23 ms, b1 even. 128 queries a block, end to end
    # (2026-12-07, tpu_session.sh prefill-bq / prefill-bq-8b): 1B 8 x 1024 66.6 -> 69.2% MFU,
    # 1 x 8191 44.7 -> 45.9%; 8B (FP8) even, 76.6 / 67.7 -> 76.8 / 67.9%. 1024-token KV blocks for
    # prefill too, with 64 MiB of scoped VMEM (of 128; the 16 MiB default does not hold their f32
    # scores): a 1024-token chunk at 8k context (1B heads) 1894 -> 1162 us, at 2k 588 -> 482 us
    # (attention_tpu.py --sweep --sweep-vmem-mib 64, 2026-12-07), fewer items each updating the
    # VMEM softmax state.
    "v5 lite": _V5E,
    "v5e": _V5E,
    "v5p": BlockSizes(32, 512),
    "v5": BlockSizes(32, 512),
    "v4": BlockSizes(32, 512),
    "v6": BlockSizes(64, 512),  # v6e (Trillium): 256x256 MXU, 32 MiB scoped VMEM
    "7": BlockSizes(64, 1024),  # v7x: 64 MiB VMEM per TensorCore
}
_FALLBACK_BLOCK_SIZES = BlockSizes(32, 512)
# VMEM for the two KV block buffers (both slots). The measured v5e decode block (1024 tokens of
# 16 bf16 heads x 128) takes this much; with the query / output blocks and the f32 softmax state
# it stayed inside the 16 MiB default of scoped VMEM, where a 32-KV-head, head_dim-64 model (rows
# of 64 heads x 128 lanes) at 512 tokens a block needed 19 MiB and did not compile on a v5e.
_KV_BUFFER_BYTES = 8 << 20
# VMEM for the fused decode path's two KV buffers (``fused_items`` blocks each).
_FUSED_BUFFER_BYTES = 16 << 20
# Query rows a block may hold (bq x query heads x lane-padded head dim): the q, output and f32
# accumulator blocks grow with it beside the KV buffers. 128 queries of 32 heads x 128 lanes (the
# 8B shape) compiled and ran on a v5e; more query heads get proportionally fewer queries a block.
_Q_BLOCK_ELEMS = 128 * 32 * 128
# f32 scores of one KV head over one item (query rows x KV tokens): 128 queries x GQA 4 x 1024
# tokens (the 1B and 8B shapes) compiled with 64 MiB of scoped VMEM on a v5e; models with wider
# GQA groups get fewer KV tokens a prefill block rather than an untried VMEM footprint.
_SCORE_ELEMS = 512 * 1024


def _device_kind() -> str:
    try:
        return jax.devices()[0].device_kind.lower()
    except RuntimeError:
        return ""


def generation_block_sizes(device_kind: str | None = None) -> BlockSizes:
    """The ``BlockSizes`` of a device kind (None: this process's first device)."""
    kind = _device_kind() if device_kind is None else device_kind.lower()
    if "tpu" in kind:
        for key, value in _BLOCK_SIZES_BY_GENERATION.items():
            if key in kind:
                return value
    return _FALLBACK_BLOCK_SIZES


def default_block_sizes(
    page_size: int,
    num_tokens: int,
    num_seq_slots: int,
    device_kind: str | None = None,
    kv_itemsize: int = 2,
    cache_heads: int = 16,
    head_dim: int = 128,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
) -> tuple[int, int]:
    """(num_queries_per_block, num_kv_pages_per_block) for a step's static shapes. The KV token
    counts are for 16-bit caches; a 32-bit cache gets half as many (same VMEM bytes), a 1-byte
    (FP8) cache as many as 16-bit (its padded rows of up to 32 heads take bf16's bytes; its decode
    temporaries are not measured on a chip yet), and a cache with wider token rows (``cache_heads`` x ``head_dim``, the head dim in whole 128-lane tiles)
    as many as keep the two KV buffers within ``_KV_BUFFER_BYTES``. Queries a block are halved
    while ``num_q_heads`` x that x the lane-padded head dim exceeds ``_Q_BLOCK_ELEMS``, and a
    prefill block's KV tokens while its f32 scores (queries x GQA group x tokens) exceed
    ``_SCORE_ELEMS``."""
    sizes = generation_block_sizes(device_kind)
    decode = num_tokens <= num_seq_slots
    bq = sizes.num_queries_per_block
    while bq > 8 and bq * num_q_heads * device_head_dim("pallas_tpu", head_dim) > _Q_BLOCK_ELEMS:
        bq //= 2
    bq = 1 if decode else min(bq, num_tokens)
    tokens = sizes.kv_tokens_per_block
    if decode and sizes.decode_kv_tokens_per_block is not None:
        tokens = sizes.decode_kv_tokens_per_block
    tokens = tokens * 2 // max(kv_itemsize, 2)
    row_bytes = cache_heads * device_head_dim("pallas_tpu", head_dim) * kv_itemsize
    tokens = min(tokens, _KV_BUFFER_BYTES // (2 * row_bytes))
    if not decode:
        tokens = min(tokens, max(page_size, _SCORE_ELEMS // (bq * max(1, num_q_heads // num_kv_heads))))
    return bq, max(1, tokens // page_size)


def _kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1]
    kv_lens_ref,  # i32[S]
    page_indices_ref,  # i32[S * pages_per_seq]
    cu_q_lens_ref,  # i32[S + 1]
    num_seqs_ref,  # i32[1]
    first_seq_ref,  # i32[NB]
    # inputs
    q_ref,  # VMEM [1, Hkv, bq*G, D]
    sinks_ref,  # SMEM f32[Hq] attention-sink logits, or None
    new_kv_hbm,  # ANY [T, C, D] (cache dtype, padding heads zero), or None
    kv_in_hbm,  # ANY [L, P, page_size*C, D], aliased to kv_hbm
    # outputs
    o_ref,  # VMEM [1, Hkv, bq*G, D]
    kv_hbm,  # ANY [L, P, page_size*C, D]: row r*C + c is token row r, combined head c
    # scratch
    kv_buf,  # VMEM [2, kv_block*C, D], same row order
    kv_sems,  # DMA semaphores [2]
    write_sem,  # DMA semaphore [1]
    next_slot_ref,  # SMEM i32[1]: slot holding the current step's first KV block
    m_ref,  # VMEM f32 [Hkv, bq*G, 1]
    l_ref,  # VMEM f32 [Hkv, bq*G, 1]
    acc_ref,  # VMEM f32 [Hkv, bq*G, D]
    *,
    bq: int,
    group: int,
    page_size: int,
    num_combined: int,
    cache_heads: int,
    pages_per_seq: int,
    pages_per_block: int,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    v_scale: float | None,
    packed_loads: bool,
    byte_values=None,
    single_item: bool = False,
    lane_packed: bool = False,
    fused_chunk_tokens: int = 0,
    fused_items: int = 1,
):
    del kv_in_hbm  # same buffer as kv_hbm; every read and write goes through the output ref
    blk = pl.program_id(0)
    num_blocks = pl.num_programs(0)
    num_slots = kv_lens_ref.shape[0]
    num_kv_heads = num_combined // 2  # real heads; combined heads >= num_combined are padding
    page_rows = page_size * cache_heads  # rows of one page in the 2-D views
    kv_block = pages_per_block * page_size
    rows = bq * group
    layer = layer_ref[0]
    total = cu_q_lens_ref[num_seqs_ref[0]]  # real tokens in the step

    # ---- per (block, sequence) bookkeeping; token t of sequence s sits at kv_len - q_end + t ----
    def token_range(b, s):
        """First and last token of sequence s inside query block b (empty if lo > hi)."""
        lo = jnp.maximum(cu_q_lens_ref[s], b * bq)
        hi = jnp.minimum(cu_q_lens_ref[s + 1], b * bq + bq) - 1
        return lo, hi

    def kv_block_range(b, s):
        """KV blocks that rows of sequence s in query block b can see (causal + window)."""
        lo, hi = token_range(b, s)
        shift = kv_lens_ref[s] - cu_q_lens_ref[s + 1]
        last = lax.div(shift + hi, kv_block)  # operands are >= 0: truncation is floor
        if sliding_window is None:
            first = jnp.int32(0)
        else:
            first = lax.div(jnp.maximum(shift + lo - sliding_window + 1, 0), kv_block)
        return first, last

    def seq_owning(token, start):
        """The sequence (>= start) whose query range holds ``token``; skips empty sequences."""

        def cond(x):
            return jnp.logical_and(x < num_slots - 1, cu_q_lens_ref[jnp.minimum(x + 1, num_slots)] <= token)

        return lax.while_loop(cond, lambda x: x + 1, start)

    def first_item(b):
        s = first_seq_ref[b]
        return s, kv_block_range(b, s)[0]

    def next_item(b, s, kvb):
        """The work item after (s, kvb) in query block b, and whether there is one."""
        _, last = kv_block_range(b, s)
        _, hi = token_range(b, s)
        more_seqs = hi + 1 < jnp.minimum(b * bq + bq, total)
        s_next = seq_owning(hi + 1, jnp.minimum(s + 1, num_slots - 1))
        first_next, _ = kv_block_range(b, s_next)
        same_seq = kvb < last
        ns = jnp.where(same_seq, s, s_next)
        nkvb = jnp.where(same_seq, kvb + 1, first_next)
        return ns, nkvb, jnp.logical_or(same_seq, more_seqs)

    # ---- KV block DMAs: one per page below kv_len; start and wait loop over the same count ----
    def page_copy(s, kvb, j, slot, row0=0):
        page = page_indices_ref[s * pages_per_seq + kvb * pages_per_block + j]
        return pltpu.make_async_copy(
            kv_hbm.at[layer, page], kv_buf.at[slot, pl.ds(row0 + j * page_rows, page_rows)], kv_sems.at[slot]
        )

    def pages_in_block(s, kvb):
        pages_of_seq = lax.div(kv_lens_ref[s] + page_size - 1, page_size)
        return jnp.clip(pages_of_seq - kvb * pages_per_block, 0, pages_per_block)

    def start_fetch(s, kvb, slot, row0=0):
        """Start the DMAs of (s, kvb)'s pages into ``slot`` from buffer row ``row0`` on."""

        def body(j, carry):
            page_copy(s, kvb, j, slot, row0).start()
            return carry

        lax.fori_loop(0, pages_in_block(s, kvb), body, 0)

    def wait_fetch(s, kvb, slot, row0=0):
        def body(j, carry):
            page_copy(s, kvb, j, slot, row0).wait()
            return carry

        lax.fori_loop(0, pages_in_block(s, kvb), body, 0)

    # ---- KV write prologue ----
    def write_new_kv():
        def row_copy(t, page, row):
            # The whole row, padding heads included (zero-padded outside): tile-aligned slices.
            dst = kv_hbm.at[layer, page, pl.ds(row * cache_heads, cache_heads)]
            return pltpu.make_async_copy(new_kv_hbm.at[t], dst, write_sem)

        any_row = row_copy(0, 0, 0)  # a wait only needs the semaphore and the byte count

        def body(t, s):
            s = seq_owning(t, s)
            pos = kv_lens_ref[s] - cu_q_lens_ref[s + 1] + t
            page = page_indices_ref[s * pages_per_seq + lax.div(pos, page_size)]

            @pl.when(t >= _MAX_WRITES_IN_FLIGHT)
            def _():
                any_row.wait()

            row_copy(t, page, lax.rem(pos, page_size)).start()
            return s

        lax.fori_loop(0, total, body, jnp.int32(0))

        def drain(_, carry):
            any_row.wait()
            return carry

        lax.fori_loop(0, jnp.minimum(total, _MAX_WRITES_IN_FLIGHT), drain, 0)

    # ---- one KV head over the block in ``slot``: its masked scores and its V ----
    def head_scores(h, slot, mask, v_ok, words):
        """(scores [rows, kv_block] f32 with masked entries at ``mask_value``, V [kv_block, D] in
        the query dtype with rows past kv_len zeroed, the matmul precision) of KV head ``h``.
        ``mask`` and ``v_ok`` None: every row sees every KV row of the block, all of them written."""
        q = q_ref[0, h]  # [rows, D]
        k, v = _load_kv_head(
            kv_buf.at[slot], h, kv_block, cache_heads, packed_loads, byte_values, words, lane_packed
        )
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        if v_ok is not None:
            v = jnp.where(v_ok, v, jnp.zeros_like(v))  # stale / NaN rows past kv_len
        precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        scores = lax.dot_general(  # q came scaled by sm_scale * k_scale
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        if mask is None:
            return scores, v, precision
        return jnp.where(mask, scores, mask_value), v, precision

    def weighted_values(p, v, precision):
        """p [rows, kv_block] @ V -> [rows, D] f32."""
        return lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    # ---- attention of this block's rows of sequence s over one KV block ----
    def attend(s, kvb, slot):
        q_start = cu_q_lens_ref[s] - blk * bq  # sequence's token range, relative to the block
        q_end = cu_q_lens_ref[s + 1] - blk * bq
        kv_len = kv_lens_ref[s]
        # Block-relative token t_local has position base + t_local; row = t_local * G + g.
        base = kv_len - cu_q_lens_ref[s + 1] + blk * bq
        # An item whose rows all belong to s and all see every KV row of the block (a long prompt's
        # blocks before its diagonal: most of a long prefill's items) needs no mask, so none is
        # built or applied (VPU work per score).
        whole = _sees_whole_kv_block(q_start, q_end, base, kvb * kv_block, bq, kv_block, sliding_window)

        def masks():
            row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
            kv_pos = kvb * kv_block + lax.broadcasted_iota(jnp.int32, (1, kv_block), 1)
            dist = kv_pos - base  # kv position relative to the block's first token position
            # t_local >= x  <=>  row >= x * G: masks from integer products only.
            mask = (row >= q_start * group) & (row < q_end * group) & (row >= dist * group)
            if sliding_window is not None:
                mask &= row < (dist + sliding_window) * group
            v_ok = (kvb * kv_block + lax.broadcasted_iota(jnp.int32, (kv_block, 1), 0)) < kv_len
            return mask, v_ok

        def update(mask, v_ok):
            words = {}  # 1-byte cache: one word load serves heads 2w and 2w + 1
            for h in range(num_kv_heads):
                scores, v, precision = head_scores(h, slot, mask, v_ok, words)
                m_prev = m_ref[h]
                m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
                p = jnp.exp(scores - m_new)
                if mask is not None:
                    p = jnp.where(mask, p, 0.0)
                alpha = jnp.exp(m_prev - m_new)
                l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
                acc_ref[h] = alpha * acc_ref[h] + weighted_values(p, v, precision)
                m_ref[h] = m_new

        @pl.when(whole)
        def _():
            update(None, None)

        @pl.when(jnp.logical_not(whole))
        def _():
            update(*masks())

    # ---- decode fast path: one token per grid step, its sequence's pages in one KV block ----
    def attend_single(s, slot):
        """This step's token (block ``blk``) over its sequence's whole KV block, softmax computed
        at once in registers: no running max / sum / accumulator kept in VMEM between items."""
        kv_len = kv_lens_ref[s]
        pos = kv_len - cu_q_lens_ref[s + 1] + blk  # the token's position in its sequence
        kv_pos = lax.broadcasted_iota(jnp.int32, (rows, kv_block), 1)  # full shape: no i1 broadcast
        mask = kv_pos <= pos  # causal; pos < kv_len, so only written rows
        if sliding_window is not None:
            mask &= kv_pos > pos - sliding_window
        v_ok = lax.broadcasted_iota(jnp.int32, (kv_block, 1), 0) < kv_len
        words = {}
        for h in range(num_kv_heads):
            scores, v, precision = head_scores(h, slot, mask, v_ok, words)
            p = jnp.where(mask, jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True)), 0.0)
            out = weighted_values(p, v, precision) / jnp.sum(
                p, axis=1, keepdims=True
            )  # >= 1: the max counts exp(0)
            if v_scale is not None:
                out = out * v_scale
            o_ref[0, h] = out.astype(o_ref.dtype)

    # ---- decode fast path on a lane-packed cache: every KV head at once, several tokens a step ----
    if fused_chunk_tokens:
        _fused_decode_steps(
            kv_lens_ref,
            cu_q_lens_ref,
            first_seq_ref,
            q_ref,
            o_ref,
            kv_buf,
            next_slot_ref,
            start_fetch=start_fetch,
            wait_fetch=wait_fetch,
            write_new_kv=None if new_kv_hbm is None else write_new_kv,
            total=total,
            group=group,
            page_size=page_size,
            cache_heads=cache_heads,
            kv_block=kv_block,
            chunk=fused_chunk_tokens,
            items=fused_items,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            mask_value=mask_value,
            v_scale=v_scale,
        )
        return

    if single_item:
        # bq == 1 and no sequence has more pages than a KV block: grid step ``blk`` is exactly one
        # item, (the sequence of token blk, KV block 0). Each step starts the next step's pages
        # into the other slot before waiting for its own, as the general path's last item does.
        @pl.when(blk == 0)
        def _prologue_single():
            if new_kv_hbm is not None:
                write_new_kv()

            @pl.when(total > 0)
            def _():
                start_fetch(first_seq_ref[0], 0, 0)
                next_slot_ref[0] = 0

        @pl.when(blk < total)
        def _work_single():
            s = first_seq_ref[blk]
            slot = next_slot_ref[0]

            @pl.when(blk + 1 < total)
            def _():
                start_fetch(first_seq_ref[blk + 1], 0, 1 - slot)

            next_slot_ref[0] = 1 - slot
            wait_fetch(s, 0, slot)
            attend_single(s, slot)

        @pl.when(blk >= total)
        def _padding_single():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

        return

    # ---- the step ----
    @pl.when(blk == 0)
    def _prologue():
        if new_kv_hbm is not None:
            write_new_kv()

        @pl.when(total > 0)
        def _():
            s, kvb = first_item(0)
            start_fetch(s, kvb, 0)
            next_slot_ref[0] = 0

    if sinks_ref is None:
        m_ref[...] = jnp.full(m_ref.shape, mask_value, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    else:
        # A sink is a key with logit s_h and no value: the softmax starts as if it had seen it
        # (max s_h, denominator exp(s_h - s_h) = 1, nothing accumulated). Row t*G + g is query
        # head h*G + g; g = row mod G comes from an f32 product (exact at these sizes), as Mosaic
        # has no cheap vector integer division.
        row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        token = ((row.astype(jnp.float32) + 0.5) * (1.0 / group)).astype(jnp.int32)  # floor: >= 0
        head_in_group = row - token * group
        for h in range(num_kv_heads):
            start = jnp.full((rows, 1), sinks_ref[h * group], jnp.float32)
            for g in range(1, group):
                start = jnp.where(head_in_group == g, sinks_ref[h * group + g], start)
            m_ref[h] = start
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(blk * bq < total)
    def _work():
        s0, kvb0 = first_item(blk)

        def body(carry):
            s, kvb, slot, _ = carry
            ns, nkvb, has_next = next_item(blk, s, kvb)
            # The next item's pages are started before this item's are waited for: the other slot
            # was last read by the previous item's attend, which has finished, and while the scalar
            # core issues these DMAs (one a page) this item's are still streaming, so HBM never
            # idles between blocks (issuing after the wait left it idle for the whole issue loop).

            @pl.when(has_next)
            def _():
                start_fetch(ns, nkvb, 1 - slot)

            # Last item of the step: prefetch the next step's first block (if it has tokens).
            @pl.when(
                jnp.logical_and(
                    jnp.logical_not(has_next), jnp.logical_and(blk + 1 < num_blocks, (blk + 1) * bq < total)
                )
            )
            def _():
                fs, fkvb = first_item(blk + 1)
                start_fetch(fs, fkvb, 1 - slot)
                next_slot_ref[0] = 1 - slot

            wait_fetch(s, kvb, slot)
            attend(s, kvb, slot)
            return ns, nkvb, 1 - slot, has_next

        lax.while_loop(lambda c: c[3], body, (s0, kvb0, next_slot_ref[0], jnp.bool_(True)))

    for h in range(num_kv_heads):
        l = l_ref[h]
        out = acc_ref[h] / jnp.where(l > 0.0, l, 1.0)  # l == 0 only for padding rows (acc == 0)
        if v_scale is not None:
            out = out * v_scale
        o_ref[0, h] = out.astype(o_ref.dtype)


def _fused_decode_steps(
    kv_lens_ref,
    cu_q_lens_ref,
    first_seq_ref,
    q_ref,  # VMEM [k, 1, Hq, 2D]: tokens blk*k .. blk*k + k - 1, row h*G + g = query head h*G + g
    o_ref,  # VMEM [k, 1, Hq, 2D]
    kv_buf,  # VMEM [2, k * kv_block * C, 2D]: item i's block from row i * kv_block * C
    next_slot_ref,
    *,
    start_fetch,
    wait_fetch,
    write_new_kv,
    total,
    group: int,
    page_size: int,
    cache_heads: int,
    kv_block: int,
    chunk: int,
    items: int,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    v_scale: float | None,
):
    """The one-item decode path on a lane-packed cache with every KV head in one matmul pair, for
    ``items`` tokens a grid step (``fused_heads``).

    A block buffer ``[kv_block * C, 2D]`` is used as it lies: row ``t*C + c`` is ``[K_c | V_c]`` of
    token t. All ``Hq`` query rows (zeros in the V lanes) score every head's keys in one matmul; a
    score counts only where the column's head ``c = col mod C`` (C a power of two: an AND) is the
    row's (``c*G <= row < c*G + G``), and ``p @ rows`` carries ``p . V_h`` in the V lanes. That is
    C times the MXU and softmax work of the per-head loop, traded for no strided loads, no bf16
    unpacking and one matmul pair a chunk instead of one a head. Each token walks only the chunks
    of ``chunk`` tokens it can see (not the whole page-table bucket), online softmax in registers.
    On a v5e one token's chunks form a serial chain (scores -> softmax -> PV -> next chunk), so
    the ``items`` tokens of a grid step advance together, chunk c of every item in one loop body,
    for the scheduler to overlap their chains. Rows past kv_len up to the last chunk read are
    zeroed in VMEM after the fetch (unfetched pages are stale or NaN there, and 0 * NaN is NaN)."""
    blk = pl.program_id(0)
    block_rows = kv_block * cache_heads
    chunk_rows = chunk * cache_heads
    page_rows = page_size * cache_heads
    num_chunks = kv_block // chunk
    log_c = cache_heads.bit_length() - 1

    def each_item(step, slot, fetch):
        """``fetch`` (start or wait) the blocks of grid step ``step``'s real tokens in ``slot``."""
        for i in range(items):
            t = step * items + i

            @pl.when(t < total)
            def _():
                fetch(first_seq_ref[t], 0, slot, i * block_rows)

    @pl.when(blk == 0)
    def _prologue():
        if write_new_kv is not None:
            write_new_kv()

        @pl.when(total > 0)
        def _():
            each_item(0, 0, start_fetch)
            next_slot_ref[0] = 0

    def zero_tail(slot, i, kv_len, last):
        """Zero item i's rows from token kv_len to the end of chunk ``last`` (whole pages)."""
        base = i * block_rows
        first_page = lax.div(kv_len, page_size)

        @pl.when(lax.rem(kv_len, page_size) != 0)
        def _():
            rows = kv_buf.at[slot, pl.ds(pl.multiple_of(base + first_page * page_rows, page_rows), page_rows)]
            token = first_page * page_size + lax.shift_right_logical(
                lax.broadcasted_iota(jnp.int32, (page_rows, 1), 0), log_c
            )
            x = rows[...]
            rows[...] = jnp.where(token < kv_len, x, jnp.zeros_like(x))

        def body(j, carry):
            start = pl.multiple_of(base + j * page_rows, page_rows)
            kv_buf[slot, pl.ds(start, page_rows), :] = jnp.zeros((page_rows, kv_buf.shape[-1]), kv_buf.dtype)
            return carry

        end_page = lax.div((last + 1) * chunk + page_size - 1, page_size)
        lax.fori_loop(lax.div(kv_len + page_size - 1, page_size), end_page, body, 0)

    def compute(slot):
        num_rows = q_ref.shape[2]
        precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
        state = []
        for i in range(items):
            t = blk * items + i
            valid = t < total
            s = first_seq_ref[t]
            kv_len = kv_lens_ref[s]
            pos = kv_len - cu_q_lens_ref[s + 1] + t  # the token's position in its sequence
            first = jnp.int32(0)
            if sliding_window is not None:
                first = lax.div(jnp.maximum(pos - sliding_window + 1, 0), chunk)
            last = lax.div(jnp.maximum(pos, 0), chunk)
            count = jnp.where(valid, last - first + 1, 0)

            @pl.when(valid)
            def _():
                zero_tail(slot, i, kv_len, last)

            state.append((valid, pos, first, jnp.minimum(last, num_chunks - 1), count))

        def body(c, carry):
            col = lax.broadcasted_iota(jnp.int32, (num_rows, chunk_rows), 1)
            row = lax.broadcasted_iota(jnp.int32, (num_rows, chunk_rows), 0)
            head_first_row = (col & (cache_heads - 1)) * group
            own_head = (row >= head_first_row) & (row < head_first_row + group)
            col_token = lax.shift_right_logical(col, log_c)
            out = []
            for i in range(items):
                m, l, acc = carry[i]
                _, pos, first, last, count = state[i]
                ci = jnp.maximum(jnp.minimum(first + c, last), 0)  # past its chunks: masked re-read
                start = pl.multiple_of(i * block_rows + ci * chunk_rows, chunk_rows)
                kv = kv_buf[slot, pl.ds(start, chunk_rows), :]
                q = q_ref[i, 0]  # [Hq, 2D], scaled by sm_scale * k_scale
                token = ci * chunk + col_token
                mask = own_head & (token <= pos) & (c < count)
                if sliding_window is not None:
                    mask = mask & (token > pos - sliding_window)
                scores = lax.dot_general(
                    q,
                    kv.astype(q.dtype),
                    (((1,), (1,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                if soft_cap is not None:
                    scores = soft_cap * jnp.tanh(scores / soft_cap)
                # A real token's first chunk holds a visible key of every row's head, so from then
                # on m is a real score and a masked entry's exp(mask_value - m) is exactly 0.
                scores = jnp.where(mask, scores, mask_value)
                m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
                p = jnp.exp(scores - m_new)
                alpha = jnp.exp(m - m_new)
                l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
                acc = alpha * acc + lax.dot_general(
                    p.astype(kv.dtype),
                    kv,
                    (((1,), (0,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                out.append((m_new, l, acc))
            return tuple(out)

        init = tuple(
            (
                jnp.full((num_rows, 1), mask_value, jnp.float32),
                jnp.zeros((num_rows, 1), jnp.float32),
                jnp.zeros((num_rows, q_ref.shape[3]), jnp.float32),
            )
            for _ in range(items)
        )
        steps = state[0][4]
        for item in state[1:]:
            steps = jnp.maximum(steps, item[4])
        final = lax.fori_loop(0, steps, body, init)
        for i in range(items):
            _, l, acc = final[i]
            out = acc / jnp.where(l > 0.0, l, 1.0)  # l >= 1 for a real token: the max counts exp(0)
            if v_scale is not None:
                out = out * v_scale
            # a padding token's state saw no fetched rows (stale, maybe NaN): its output is zeros
            o_ref[i, 0] = jnp.where(state[i][0], out, 0.0).astype(o_ref.dtype)

    @pl.when(blk * items < total)
    def _work():
        slot = next_slot_ref[0]

        @pl.when((blk + 1) * items < total)
        def _():
            each_item(blk + 1, 1 - slot, start_fetch)

        next_slot_ref[0] = 1 - slot
        each_item(blk, slot, wait_fetch)
        compute(slot)

    @pl.when(blk * items >= total)
    def _padding():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _sees_whole_kv_block(q_start, q_end, base, kv_first, bq: int, kv_block: int, sliding_window):
    """Whether every row of a query block belongs to one sequence and sees every KV row of one of
    its KV blocks, so the item needs no mask (and no zeroing of V rows: all are below kv_len).

    ``q_start`` / ``q_end``: the sequence's token range relative to the block (rows ``0 .. bq-1``);
    ``base``: the position of the block's first row; ``kv_first``: the KV block's first position.
    Works on Python ints and traced int32 scalars alike."""
    whole = (q_start <= 0) & (q_end >= bq) & (kv_first + kv_block - 1 <= base)
    if sliding_window is not None:  # the last row's window must still reach the block's first row
        whole = whole & (kv_first > base + bq - 1 - sliding_window)
    return whole


def _load_kv_head(
    buf,
    h: int,
    kv_block: int,
    cache_heads: int,
    packed_loads: bool,
    byte_values=None,
    words=None,
    lane_packed: bool = False,
):
    """K and V ``[kv_block, D]`` of KV head ``h`` from one block buffer ``[kv_block*C, D]``.

    Sublane-strided loads pick one combined head out of every token's C rows; padding heads
    (>= 2*Hkv) are fetched with their page but never loaded from the buffer. Mosaic strides 32-bit
    data only, so with ``packed_loads`` (compiled kernels) a bf16 buffer is read as uint32 rows,
    each packing two bf16 rows (the even one in the low half): K_h and V_h (rows 2h, 2h+1) share
    row h of a token's C/2, and moving each half to the top of a 32-bit word gives its exact value
    as f32. TPU interpret mode cannot index a bitcast ref, so it loads bf16 rows directly (same
    values); the compiled unpacking is checked on a TPU by benchmarks/attention_tpu.py.

    ``byte_values`` (a float8 dtype): the buffer holds 1-byte FP8 codes (as uint8 or as that
    float8 type); K and V come back as f32 values, decoded with integer ops (``_fp8_to_f32``).
    ``words`` (a dict the caller keeps over one KV block's head loop): the loaded words by index,
    so heads 2w and 2w + 1 share one load of word w.

    ``lane_packed`` (``pack_kv_lanes``'s layout, head_dim 64): row h of a token is ``[K_h | V_h]``
    in 128 lanes, so K and V come back as that same ``[kv_block, 2*D]`` row: the queries carry
    zeros in the V lanes (scores see K only) and the caller keeps the V lanes of ``p @ row``. In
    bf16 one uint32 word row holds heads 2w (low half) and 2w + 1 (high half); with ``byte_values``
    (1-byte FP8 codes) a word holds heads 4w .. 4w + 3, head 4w + j in byte j, decoded to f32.
    """
    if lane_packed:
        if byte_values is not None:
            words = {} if words is None else words
            if h // 4 not in words:
                words.clear()
                words[h // 4] = _packed_byte_rows(buf, h // 4, kv_block, cache_heads, packed_loads)
            row = _fp8_to_f32(lax.shift_right_logical(words[h // 4], 8 * (h % 4)) & 0xFF, byte_values)
            return row, row
        if jnp.dtype(buf.dtype).itemsize == 4 or not packed_loads:
            row = buf[pl.ds(h, kv_block, stride=cache_heads), :]
            return row, row
        words = {} if words is None else words
        if h // 2 not in words:
            words.clear()
            words[h // 2] = buf.bitcast(jnp.uint32)[pl.ds(h // 2, kv_block, stride=cache_heads // 2), :]
        packed = words[h // 2]
        row = pltpu.bitcast(packed << 16 if h % 2 == 0 else packed & jnp.uint32(0xFFFF0000), jnp.float32)
        return row, row
    if byte_values is not None:
        words = {} if words is None else words
        if h // 2 not in words:
            words.clear()  # the previous pair's word is done with: keep one live
            words[h // 2] = _packed_byte_rows(buf, h // 2, kv_block, cache_heads, packed_loads)
        word = words[h // 2]
        low = 16 * (h % 2)  # K_h is byte 2h mod 4 of its word, V_h the byte above it
        k = _fp8_to_f32(lax.shift_right_logical(word, low) & 0xFF, byte_values)
        v = _fp8_to_f32(lax.shift_right_logical(word, low + 8) & 0xFF, byte_values)
        return k, v
    if jnp.dtype(buf.dtype).itemsize == 4 or not packed_loads:
        k = buf[pl.ds(2 * h, kv_block, stride=cache_heads), :]
        v = buf[pl.ds(2 * h + 1, kv_block, stride=cache_heads), :]
        return k, v
    # bf16: check_compiled_cache_dtype refused every other width before tracing.
    packed = buf.bitcast(jnp.uint32)[pl.ds(h, kv_block, stride=cache_heads // 2), :]
    k = pltpu.bitcast(packed << 16, jnp.float32)
    v = pltpu.bitcast(packed & jnp.uint32(0xFFFF0000), jnp.float32)
    return k, v


def _packed_byte_rows(buf, w: int, kv_block: int, cache_heads: int, packed_loads: bool):
    """int32 ``[kv_block, D]``: word ``w`` of every token's C byte rows, i.e. combined heads
    ``4w .. 4w+3`` of a 1-byte buffer packed four to a 32-bit word, head ``4w + j`` in byte j (bits
    8j .. 8j+7: the lowest row in the low byte, as a TPU packs 8-bit rows into a 32-bit sublane
    word, the order of the bf16 pair above). Compiled: one sublane-strided load of the buffer's
    uint32 view. TPU interpret mode (no bitcast refs) builds the same words from four strided
    byte-row loads, so the byte extraction and decoding after it run there too; only the packing
    order itself is the chip's (checked on one by benchmarks/attention_tpu.py)."""
    if packed_loads:
        word = buf.bitcast(jnp.uint32)[pl.ds(w, kv_block, stride=cache_heads // 4), :]
        return lax.bitcast_convert_type(word, jnp.int32)
    word = None
    for j in range(4):
        c = 4 * w + j
        if c >= cache_heads:  # an unpadded cache whose C is not a multiple of 4
            break
        row = buf[pl.ds(c, kv_block, stride=cache_heads), :]
        if row.dtype != jnp.uint8:
            row = lax.bitcast_convert_type(row, jnp.uint8)
        part = row.astype(jnp.int32) << (8 * j)
        word = part if word is None else word | part
    return word


# (exponent bits, mantissa bits, exponent bias) of the FP8 formats the kernel decodes.
_FP8_FORMATS = {
    jnp.dtype(jnp.float8_e4m3fn): (4, 3, 7),
    jnp.dtype(jnp.float8_e5m2): (5, 2, 15),
}


def _fp8_to_f32(code, dtype):
    """int32 FP8 codes (0..255) of ``dtype`` -> their f32 values, with 32-bit integer ops, a
    bitcast and one int -> float conversion only (no fp8 vector type, which a v5e lacks).

    A normal code (exponent field E > 0) is the f32 with exponent ``E - bias + 127`` and the
    mantissa bits at the top of f32's; a subnormal one (E == 0) is ``m * 2**(1 - bias - mbits)``.
    The NaN / inf codes are never stored (``quantize_kv`` clips to the finite range) and are not
    special-cased: e4m3fn's NaN decodes as 480, e5m2's inf / NaN as large finite values."""
    ebits, mbits, bias = _FP8_FORMATS[jnp.dtype(dtype)]
    exp = (code >> mbits) & ((1 << ebits) - 1)
    man = code & ((1 << mbits) - 1)
    normal = lax.bitcast_convert_type(((exp + (127 - bias)) << 23) | (man << (23 - mbits)), jnp.float32)
    subnormal = man.astype(jnp.float32) * jnp.float32(2.0 ** (1 - bias - mbits))
    mag = jnp.where(exp == 0, subnormal, normal)
    return jnp.where((code & 0x80) != 0, -mag, mag)


def fp8_value_dtype(cache_dtype, kv_dtype=None):
    """The float8 dtype whose codes a 1-byte cache holds, or None for a 16/32-bit cache.

    ``kv_dtype``: the values' dtype when the cache stores their bytes as uint8
    (``kv_cache_shape.kv_storage_dtype``); None: the cache's own dtype. ValueError for a pairing
    that cannot be (a uint8 cache of 2-byte values, a bf16 cache said to hold fp8)."""
    cache_dtype = jnp.dtype(cache_dtype)
    values = cache_dtype if kv_dtype is None else jnp.dtype(kv_dtype)
    if values != cache_dtype and (cache_dtype != jnp.uint8 or values.itemsize != 1):
        raise ValueError(f"a {cache_dtype.name} KV cache cannot hold {values.name} values")
    if values.itemsize != 1:
        return None
    if values not in _FP8_FORMATS:
        raise NotImplementedError(
            f"the TPU attention kernel reads float8_e4m3fn and float8_e5m2 KV caches (as such or "
            f"as uint8 bytes), not {values.name}"
        )
    return values


def check_compiled_cache_dtype(dtype, num_combined_heads: int | None = None) -> None:
    """NotImplementedError unless the compiled (Mosaic) kernel can read a ``dtype`` KV cache:
    float32, bfloat16, or 1-byte FP8 codes (``fp8_value_dtype`` says which) whose C rows a token
    fill whole 32-bit words (``num_combined_heads`` a multiple of 4)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1:
        if num_combined_heads is not None and num_combined_heads % 4:
            raise NotImplementedError(
                f"the compiled TPU attention kernel reads a 1-byte KV cache as 32-bit words of 4 "
                f"combined heads; C={num_combined_heads} is not a multiple of 4 (the padded cache "
                f"kv_cache_shape('pallas_tpu', ...) gives has C a multiple of 32)"
            )
        return
    if dtype.itemsize != 4 and dtype != jnp.bfloat16:
        raise NotImplementedError(
            f"the compiled TPU attention kernel reads float32, bfloat16 or FP8 KV caches, not "
            f"{dtype.name}: Mosaic strides 32-bit words only, and unpacking is written for bf16 "
            f"and 1-byte FP8 codes (kv_cache_dtype=auto, or attention_impl=reference, avoid it)"
        )


def pack_kv_lanes(kv_pages, num_kv_heads: int, rows: int | None = None):
    """The lane-packed layout of interleaved pages: ``[..., page_size, C >= 2*Hkv, D]`` ->
    ``[..., page_size, rows, 2*D]`` with row h = ``[K_h | V_h]`` (a reshape: heads 2h and 2h + 1
    are adjacent) and rows past Hkv zero. ``rows``: None for ``lane_packed_rows(Hkv)``. The kernel
    takes a cache whose minor dim is twice the queries' as this layout."""
    kv = kv_pages[..., : 2 * num_kv_heads, :]
    packed = kv.reshape(*kv.shape[:-2], num_kv_heads, 2 * kv.shape[-1])
    rows = lane_packed_rows(num_kv_heads) if rows is None else rows
    pad = [(0, 0)] * (packed.ndim - 2) + [(0, rows - num_kv_heads), (0, 0)]
    return jnp.pad(packed, pad)


def unpack_kv_lanes(kv_pages, num_kv_heads: int):
    """``pack_kv_lanes``' inverse on the real heads: ``[..., page_size, rows, 2*D]`` ->
    ``[..., page_size, 2*Hkv, D]`` interleaved."""
    kv = kv_pages[..., :num_kv_heads, :]
    return kv.reshape(*kv.shape[:-2], 2 * num_kv_heads, kv.shape[-1] // 2)


def _first_seq_per_block(cu_q_lens, num_blocks: int, bq: int):
    """i32[NB]: the sequence owning each query block's first token (0 for padding blocks)."""
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * bq
    seq = jnp.searchsorted(cu_q_lens[1:], starts, side="right").astype(jnp.int32)
    return jnp.minimum(seq, cu_q_lens.shape[0] - 2)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "mask_value",
        "k_scale",
        "v_scale",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "vmem_limit_bytes",
        "num_kv_heads",
        "kv_dtype",
        "interpret",
        "single_item_decode",
        "fused_heads",
        "fused_chunk_rows",
        "fused_items",
    ),
)
def ragged_paged_attention_tpu_stacked(
    queries,
    new_kv,
    kv_cache,
    layer,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    num_kv_heads: int | None = None,
    kv_dtype=None,
    interpret=None,
    sinks=None,
    single_item_decode: bool | None = None,
    fused_heads: bool | None = None,
    fused_chunk_rows: int | None = None,
    fused_items: int | None = None,
):
    """Ragged paged attention on layer ``layer`` of a stacked cache, updated in place.

    queries [T, Hq, D]; new_kv [T, 2*Hkv, D] interleaved (or None: attend without writing);
    kv_cache [L, P, page_size, C, D] with C >= 2*Hkv: combined heads past 2*Hkv are padding
    (``kv_cache_shape``), written as zero with each new token and never attended to;
    layer: int32 scalar (traced is fine); kv_lens [S], page_indices [S, pages_per_seq],
    cu_q_lens [S+1], num_seqs [1] (all int32).
    ``num_kv_heads``: Hkv; taken from new_kv when it is given, else C // 2 - so pass it when
    attending to a padded cache without writing. ``kv_dtype``: the dtype of the cached values when
    a uint8 cache holds their bytes (an FP8 cache as the engine stores it, ``kv_storage_dtype``);
    None: the cache's own dtype. A 1-byte cache (float8_e4m3fn / float8_e5m2 codes, as such or as
    uint8) is decoded in VMEM; new_kv is cast to the value dtype (the engine quantizes it first,
    ``quantize_kv``) and written as bytes. Returns (out [T, Hq, D] in queries.dtype,
    kv_cache). ``interpret``: None to compile for TPU, or a ``pltpu.InterpretParams`` to run in
    TPU interpret mode. ``sinks``: None, or f32 [Hq] attention-sink logits (traced), as in the
    reference: each row's softmax starts from its head's sink. They travel in SMEM: Hq scalars
    cost nothing there, where a VMEM block holding a sink per softmax row ([Hkv, bq*G, 1], a
    lane-padded 128 wide like m and l) would take up to MiBs of the scoped VMEM.
    ``single_item_decode``: when a step takes the decode path (bq = 1) and every sequence's pages
    fit one KV block (no sinks), run each grid step as its one item with the softmax taken at once
    (``attend_single``). None: the generation's ``BlockSizes.single_item_decode`` for a 16/32-bit
    cache (a 1-byte cache's one-item path passes interpret mode but has not run compiled on a chip).
    ``fused_heads``: on the one-item path over a lane-packed 16/32-bit cache (C a power of two),
    take every KV head of a sequence in one matmul pair over chunks of ``fused_chunk_rows`` cache
    rows, ``fused_items`` tokens a grid step (``_fused_decode_steps``). None: the generation's
    ``BlockSizes`` for each.
    """
    if mask_value is None:
        mask_value = DEFAULT_MASK_VALUE
    num_tokens, num_q_heads, head_dim = queries.shape
    _, _, page_size, cache_heads, head_dim_kv = kv_cache.shape
    if new_kv is not None:
        if num_kv_heads is not None and new_kv.shape[1] != 2 * num_kv_heads:
            raise ValueError(f"new_kv {new_kv.shape} does not hold num_kv_heads={num_kv_heads}")
        num_kv_heads = new_kv.shape[1] // 2
    elif num_kv_heads is None:
        num_kv_heads = cache_heads // 2
    num_combined = 2 * num_kv_heads
    byte_values = fp8_value_dtype(kv_cache.dtype, kv_dtype)
    lane_packed = head_dim_kv == 2 * head_dim  # pack_kv_lanes' layout: a head's K | V in one row
    if interpret is None:
        check_compiled_cache_dtype(kv_cache.dtype, cache_heads)
    num_slots, pages_per_seq = page_indices.shape
    if (
        (head_dim_kv != head_dim and not lane_packed)
        or num_kv_heads < 1
        or (num_kv_heads if lane_packed else num_combined) > cache_heads
        or num_q_heads % num_kv_heads
    ):
        raise ValueError(
            f"incompatible shapes: queries {queries.shape}, kv_cache {kv_cache.shape}, "
            f"num_kv_heads={num_kv_heads}"
        )
    if new_kv is not None and new_kv.shape != (num_tokens, num_combined, head_dim):
        raise ValueError(f"new_kv must be {(num_tokens, num_combined, head_dim)}, got {new_kv.shape}")
    group = num_q_heads // num_kv_heads
    if sinks is not None:
        sinks = sink_array(sinks, num_q_heads)
    bq, ppb = default_block_sizes(
        page_size,
        num_tokens,
        num_slots,
        kv_itemsize=jnp.dtype(kv_cache.dtype).itemsize,
        cache_heads=cache_heads,
        head_dim=head_dim,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
    )
    bq = num_queries_per_block or bq
    ppb = min(num_kv_pages_per_block or ppb, pages_per_seq)
    if single_item_decode is None:  # the generation's default, measured on 16-bit caches only
        single_item_decode = generation_block_sizes().single_item_decode and byte_values is None
    single_item = single_item_decode and bq == 1 and ppb >= pages_per_seq and sinks is None
    if fused_heads is None:
        sizes = generation_block_sizes()
        fused_heads = sizes.fused_head_decode and ppb * page_size <= sizes.fused_max_kv_tokens
    fused_chunk_tokens, items = 0, 1  # items: tokens a grid step (the fused path's)
    if fused_heads and single_item and lane_packed and byte_values is None and _is_power_of_two(cache_heads):
        if fused_chunk_rows is None:
            fused_chunk_rows = generation_block_sizes().fused_chunk_rows
        if fused_items is None:
            fused_items = generation_block_sizes().fused_items
        fused_chunk_tokens = _chunk_tokens(ppb * page_size, cache_heads, fused_chunk_rows)
        block_bytes = ppb * page_size * cache_heads * head_dim_kv * jnp.dtype(kv_cache.dtype).itemsize
        items = max(1, min(fused_items, num_tokens, _FUSED_BUFFER_BYTES // (2 * block_bytes)))
    num_blocks = pl.cdiv(num_tokens, bq * items) * items
    padded = num_blocks * bq

    # [T, Hq, D] -> [NB, Hkv, bq*G, D]: row t*G + g of KV head h is query head h*G + g.
    q = jnp.pad(queries, ((0, padded - num_tokens), (0, 0), (0, 0)))
    q = q.reshape(num_blocks, bq, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q = q.reshape(num_blocks, num_kv_heads, bq * group, head_dim)
    score_scale = sm_scale * (1.0 if k_scale is None else k_scale)
    if score_scale != 1.0:  # in f32, rounded once to the query dtype (exact for powers of two)
        q = (q.astype(jnp.float32) * score_scale).astype(queries.dtype)
    if lane_packed:  # zeros against the V lanes: q . [K | V] = q . K
        q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, head_dim)))
    if new_kv is not None:
        if byte_values is None:
            new_kv = new_kv.astype(kv_cache.dtype)
        else:  # the values' codes, bitcast to the storage type (uint8) when it differs
            new_kv = new_kv.astype(byte_values)
            if kv_cache.dtype != byte_values:
                new_kv = lax.bitcast_convert_type(new_kv, kv_cache.dtype)
        if lane_packed:  # interleaved K0 V0 K1 V1 ... -> rows [K_h | V_h]
            new_kv = new_kv.reshape(num_tokens, num_kv_heads, head_dim_kv)
        if cache_heads > new_kv.shape[1]:
            new_kv = jnp.pad(new_kv, ((0, 0), (0, cache_heads - new_kv.shape[1]), (0, 0)))

    scalars = (
        jnp.asarray(layer, jnp.int32).reshape(1),
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32).reshape(-1),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32).reshape(1),
        _first_seq_per_block(cu_q_lens.astype(jnp.int32), num_blocks, bq),
    )
    q_spec = pl.BlockSpec((1, num_kv_heads, bq * group, head_dim_kv), lambda i, *_: (i, 0, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    if fused_chunk_tokens:
        # [NB, Hkv, G, 2D] -> [NB, 1, Hq, 2D] (bq = 1): row h*G + g is query head h*G + g; a grid
        # step takes ``items`` tokens
        q = q.reshape(num_blocks, 1, num_q_heads, head_dim_kv)
        q_spec = pl.BlockSpec((items, 1, num_q_heads, head_dim_kv), lambda i, *_: (i, 0, 0, 0))
    if vmem_limit_bytes is None:
        vmem_limit_bytes = generation_block_sizes().vmem_limit_bytes
    kernel = functools.partial(
        _kernel,
        bq=bq,
        group=group,
        page_size=page_size,
        num_combined=num_combined,
        cache_heads=cache_heads,
        pages_per_seq=pages_per_seq,
        pages_per_block=ppb,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        v_scale=v_scale,
        packed_loads=interpret is None,
        byte_values=byte_values,
        single_item=single_item,
        lane_packed=lane_packed,
        fused_chunk_tokens=fused_chunk_tokens,
        fused_items=items,
    )
    if sinks is None or new_kv is None:
        kernel = functools.partial(_without_optional_inputs, kernel, sinks is not None, new_kv is not None)
    sinks_spec = [pl.BlockSpec(memory_space=pltpu.SMEM)] if sinks is not None else []
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(num_blocks // items,),
        in_specs=[q_spec] + sinks_spec + ([any_spec] if new_kv is not None else []) + [any_spec],
        out_specs=[q_spec, any_spec],
        scratch_shapes=[
            pltpu.VMEM((2, items * ppb * page_size * cache_heads, head_dim_kv), kv_cache.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA(()),
            pltpu.SMEM((1,), jnp.int32),
            pltpu.VMEM((num_kv_heads, bq * group, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, bq * group, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, bq * group, head_dim_kv), jnp.float32),
        ],
    )
    operands = (q,) + ((sinks,) if sinks is not None else ()) + ((new_kv,) if new_kv is not None else ())
    operands += (kv_cache,)
    num_layers, num_pages = kv_cache.shape[:2]
    cache_2d = kv_cache.reshape(num_layers, num_pages, page_size * cache_heads, head_dim_kv)
    operands = operands[:-1] + (cache_2d,)
    out, cache_2d = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, queries.dtype),
            jax.ShapeDtypeStruct(cache_2d.shape, kv_cache.dtype),
        ],
        input_output_aliases={len(scalars) + len(operands) - 1: 1},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=vmem_limit_bytes,
            # Every page DMA would be bounds-checked at run time (a decode step issues one per page
            # of every sequence); the page indices are the engine's own, checked when allocated.
            disable_bounds_checks=True,
        ),
        interpret=interpret if interpret is not None else False,
        name=f"ragged_paged_attention_bq{bq}_p{ppb}{'_one_item' if single_item else ''}"
        f"{f'_fused{fused_chunk_tokens}x{items}' if fused_chunk_tokens else ''}",
    )(*scalars, *operands)
    out = out.reshape(num_blocks, num_kv_heads, bq * group, head_dim_kv)

    if lane_packed:  # p @ [K | V] = [p.K | p.V]: the V lanes are the output
        out = out[..., head_dim:]
    out = out.reshape(num_blocks, num_kv_heads, bq, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(padded, num_q_heads, head_dim)[:num_tokens]
    return out, cache_2d.reshape(kv_cache.shape)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _chunk_tokens(kv_block: int, cache_heads: int, chunk_rows: int) -> int:
    """Tokens a chunk of the fused decode path: the largest divisor of ``kv_block`` whose rows
    (tokens x C) are at most ``chunk_rows`` and fill whole 16-row bf16 tiles, else the whole
    block."""
    for tokens in range(min(kv_block, max(1, chunk_rows // cache_heads)), 0, -1):
        if kv_block % tokens == 0 and (tokens * cache_heads) % 16 == 0:
            return tokens
    return kv_block


def _without_optional_inputs(kernel, has_sinks: bool, has_new_kv: bool, *refs):
    """Adapter when the sinks or new_kv operand is absent: None where the kernel expects its ref."""
    after_q = 6 + 1  # the scalar-prefetch refs, then q
    padded = list(refs)
    if not has_sinks:
        padded.insert(after_q, None)
    if not has_new_kv:
        padded.insert(after_q + 1, None)
    return kernel(*padded)


def ragged_paged_attention_tpu(
    queries,
    new_kv,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    num_kv_heads: int | None = None,
    kv_dtype=None,
    interpret=None,
    sinks=None,
    single_item_decode: bool | None = None,
    fused_heads: bool | None = None,
    fused_chunk_rows: int | None = None,
    fused_items: int | None = None,
):
    """Single-layer form: kv_pages [P, page_size, C, D]. Returns (out [T, Hq, D], kv_pages).

    Same semantics as ``write_kv_ref`` + ``ragged_paged_attention_ref``; see the module docstring.
    """
    out, kv_cache = ragged_paged_attention_tpu_stacked(
        queries,
        new_kv,
        kv_pages[None],
        jnp.int32(0),
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
        num_queries_per_block=num_queries_per_block,
        num_kv_pages_per_block=num_kv_pages_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
        num_kv_heads=num_kv_heads,
        kv_dtype=kv_dtype,
        interpret=interpret,
        sinks=sinks,
        single_item_decode=single_item_decode,
        fused_heads=fused_heads,
        fused_chunk_rows=fused_chunk_rows,
        fused_items=fused_items,
    )
    return out, kv_cache[0]

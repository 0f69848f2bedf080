"""GPU ragged paged attention: a Pallas kernel with the Triton lowering (flash-decoding over pages).

Same call and semantics as ``attention/pallas_tpu.py`` and the jnp reference (``write_kv_ref`` then
``ragged_paged_attention_ref``); runs on CPU with ``interpret=True`` for tests.

Structure (simpler than the TPU kernel; Triton schedules the loads itself):

1. This step's K/V rows are scattered into the stacked cache ``[L, P, page_size, 2*Hkv, D]`` with
   a jnp scatter (in place when the caller donates the cache), before the kernel.
2. Queries are re-laid out to ``[Hkv, T*G (+R padding), D]`` (row ``t*G + g`` is query head
   ``h*G + g`` of token t) and cut into *tiles* of R rows that never straddle two sequences: each
   sequence with q_len tokens owns ``ceil(q_len*G / R)`` tiles. Tile tables (sequence, first row)
   are computed with jnp outside the kernel, bounded statically by ``_max_tiles``.
3. grid = (tiles, Hkv, kv_splits). A program loads its [R, D] query rows for one KV head and
   walks its share of the KV blocks (``pages_per_block * page_size`` tokens) that the tile's rows
   can see (causal; sliding window), with an online softmax in f32 (with attention sinks, split 0
   of each row starts from its head's sink: max s_h, denominator 1). K and V rows are gathered
   from the flattened cache ``[L*P*page_size*2*Hkv, D]`` by computed row indices (K of head h at
   ``(..)*2*Hkv + 2h``, V right after it, so one 2*D*itemsize run per token and head).
4. With one split the kernel normalises and stores the output directly; with several (long
   contexts at small batch, to fill the SMs) each split stores (o, m, l) and a jnp epilogue merges
   them (flash-decoding). Tile rows are finally gathered back to ``[T, Hq, D]``.

The Triton lowering needs power-of-two shapes: R, D and ``pages_per_block * page_size``.
Integer offsets switch to 64 bits by themselves when the cache exceeds 4 GiB.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tpuserve.attention.reference import sink_array, token_sequence_info

DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_NUM_SMS_TARGET = 132  # H100/H200 SM count: split KV until ~2 programs per SM


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def write_kv_stacked(kv_cache, layer, new_kv, kv_lens, page_indices, cu_q_lens, num_seqs):
    """Scatter new_kv [T, 2*Hkv, D] into layer ``layer`` of kv_cache [L, P, ps, 2*Hkv, D].

    Same rows as ``write_kv_ref``; padding tokens are dropped (their page index is out of range).
    """
    _, num_pages, page_size = kv_cache.shape[:3]
    seq, pos, valid = token_sequence_info(kv_lens, cu_q_lens, num_seqs, new_kv.shape[0])
    page = jnp.where(valid, page_indices[seq, pos // page_size], num_pages)
    return kv_cache.at[layer, page, pos % page_size].set(new_kv.astype(kv_cache.dtype), mode="drop")


def _max_tiles(num_tokens: int, group: int, rows: int, num_slots: int) -> int:
    """Static bound on tiles: sum over sequences of ceil(q_len*G/R)."""
    return max(
        1,
        min(
            pl.cdiv(num_tokens * group, rows) + min(num_slots, num_tokens), num_tokens * pl.cdiv(group, rows)
        ),
    )


def _tile_tables(cu_q_lens, num_seqs, group: int, rows: int, num_tiles: int):
    """i32[NT] tile -> sequence (-1 for unused tiles), i32[NT] first row, i32[S+1] tile base."""
    num_slots = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    live = jnp.arange(num_slots) < num_seqs[0]
    per_seq = jnp.where(live, (q_lens * group + rows - 1) // rows, 0)
    base = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_seq).astype(jnp.int32)])
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(base[1:], tile, side="right"), num_slots - 1)
    seq = seq.astype(jnp.int32)
    row0 = cu_q_lens[seq] * group + (tile - base[seq]) * rows
    used = tile < base[-1]
    return jnp.where(used, seq, -1), jnp.where(used, row0, 0), base


def _kernel(
    tile_seq_ref,  # i32[NT]
    tile_row0_ref,  # i32[NT]
    kv_lens_ref,  # i32[S]
    cu_q_lens_ref,  # i32[S + 1]
    page_table_ref,  # i32[S * pages_per_seq_padded]
    layer_ref,  # i32[1]
    q_ref,  # [Hkv, T*G + R, D]
    kv_ref,  # [L*P*page_size*2*Hkv, D]
    *refs,  # with sinks: f32[Hq]; then o: [R, D] block of [NT, Hkv, K, R, D]; with K > 1: m, l [R] blocks
    has_sinks: bool,
    rows: int,
    group: int,
    page_size: int,
    num_pages: int,
    num_combined: int,
    pages_per_seq: int,
    pages_per_block: int,
    num_splits: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    k_scale: float | None,
    v_scale: float | None,
):
    sinks_ref, (o_ref, *stats_refs) = (refs[0], refs[1:]) if has_sinks else (None, refs)
    tile, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_block = pages_per_block * page_size
    seq_raw = tile_seq_ref[tile]
    used = seq_raw >= 0
    seq = jnp.maximum(seq_raw, 0)
    row0 = tile_row0_ref[tile]
    q_end = cu_q_lens_ref[seq + 1]
    kv_len = kv_lens_ref[seq]
    layer = layer_ref[0]

    q = q_ref[h, pl.ds(row0, rows), :]  # [R, D]
    row = row0 + lax.broadcasted_iota(jnp.int32, (rows,), 0)
    row_ok = row < q_end * group
    q_pos = kv_len - q_end + lax.div(row, group)  # [R]; all operands >= 0

    # KV blocks the tile's rows can see, then this split's share of them.
    last_row = jnp.minimum(row0 + rows, q_end * group) - 1
    last_blk = (kv_len - q_end + last_row // group) // kv_block
    if sliding_window is None:
        first_blk = jnp.int32(0)
    else:
        first_pos = kv_len - q_end + row0 // group
        first_blk = jnp.maximum(first_pos - sliding_window + 1, 0) // kv_block
    num_blk = jnp.where(used, last_blk - first_blk + 1, 0)
    per_split = (num_blk + num_splits - 1) // num_splits
    lo = first_blk + split * per_split
    hi = jnp.minimum(lo + per_split, first_blk + num_blk)

    tok = lax.broadcasted_iota(jnp.int32, (kv_block,), 0)
    tok_page, tok_row = lax.div(tok, page_size), lax.rem(tok, page_size)  # page, row in block
    score_scale = sm_scale * (1.0 if k_scale is None else k_scale)

    def body(blk, carry):
        acc, m, l = carry
        page = page_table_ref[seq * pages_per_seq + blk * pages_per_block + tok_page]
        # int32 row index: fine below 2**31 rows, i.e. caches under 2**31 * D * itemsize bytes.
        kv_row = ((layer * num_pages + page) * page_size + tok_row) * num_combined + 2 * h
        k = kv_ref[kv_row, :].astype(q.dtype)  # [kv_block, D]
        v = kv_ref[kv_row + 1, :].astype(q.dtype)
        kv_pos = blk * kv_block + tok
        v = jnp.where((kv_pos < kv_len)[:, None], v, jnp.zeros_like(v))  # unwritten rows
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * score_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = row_ok[:, None] & (kv_pos[None, :] <= q_pos[:, None])
        if sliding_window is not None:
            mask = mask & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        s = jnp.where(mask, s, mask_value)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return acc, m_new, l

    head_dim = q.shape[-1]
    acc0 = jnp.zeros((rows, head_dim), jnp.float32)
    m0 = jnp.full((rows,), mask_value, jnp.float32)
    l0 = jnp.zeros((rows,), jnp.float32)
    if sinks_ref is not None:
        # A sink is a key with logit s_h and no value: start as if it had been seen (max s_h,
        # denominator 1). Only split 0 does, so the flash-decoding merge counts it once.
        sink = sinks_ref[h * group + lax.rem(row, group)]  # row t*G + g is query head h*G + g
        m0 = jnp.where(split == 0, sink, m0)
        l0 = jnp.where(split == 0, 1.0, l0)
    init = (acc0, m0, l0)
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    if v_scale is not None:
        acc = acc * v_scale
    if num_splits == 1:
        o_ref[...] = (acc / jnp.where(l > 0.0, l, 1.0)[:, None]).astype(o_ref.dtype)
    else:
        m_ref, l_ref = stats_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def default_config(
    num_tokens: int,
    num_slots: int,
    group: int,
    num_kv_heads: int,
    page_size: int,
    pages_per_seq: int,
    kv_itemsize: int = 2,
):
    """(rows_per_tile, pages_per_block, kv_splits) for a step's static shapes.

    Decode-like steps (no more tokens than slots) use tiles of max(16, G) rows (16 is Triton's
    smallest dot) and 128-token KV blocks; prefill uses 64-row tiles and 64-token blocks. f32
    caches halve the KV block: K + V tiles times 2 pipeline stages must fit shared memory.
    """
    decode_like = num_tokens <= num_slots
    rows = max(16, _pow2_at_least(group)) if decode_like else 64
    kv_tokens = (128 if decode_like else 64) // (2 if kv_itemsize > 2 else 1)
    pages_per_block = max(1, kv_tokens // page_size)
    pages_per_block = min(pages_per_block, _pow2_at_least(pages_per_seq))
    tiles = _max_tiles(num_tokens, group, rows, num_slots)
    max_blocks = pl.cdiv(pages_per_seq, pages_per_block)
    splits = max(1, min(max_blocks, pl.cdiv(2 * _NUM_SMS_TARGET, tiles * num_kv_heads)))
    return rows, pages_per_block, splits


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "mask_value",
        "k_scale",
        "v_scale",
        "rows_per_tile",
        "num_kv_pages_per_block",
        "num_kv_splits",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def ragged_paged_attention_gpu_stacked(
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
    rows_per_tile: int | None = None,
    num_kv_pages_per_block: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    sinks=None,
):
    """Write new_kv into layer ``layer`` of kv_cache [L, P, ps, 2*Hkv, D], then attend.

    queries [T, Hq, D]; new_kv [T, 2*Hkv, D] (or None: attend only); metadata as in
    attention/reference.py; ``sinks``: None, or f32 [Hq] attention-sink logits (traced), as in the
    reference. Returns (out [T, Hq, D], kv_cache).
    """
    if mask_value is None:
        mask_value = DEFAULT_MASK_VALUE
    num_tokens, num_q_heads, head_dim = queries.shape
    num_layers, num_pages, page_size, num_combined, _ = kv_cache.shape
    num_kv_heads = num_combined // 2
    group = num_q_heads // num_kv_heads
    num_slots, pages_per_seq = page_indices.shape
    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    num_seqs = num_seqs.astype(jnp.int32).reshape(1)
    page_indices = page_indices.astype(jnp.int32)

    d_rows, d_ppb, d_splits = default_config(
        num_tokens,
        num_slots,
        group,
        num_kv_heads,
        page_size,
        pages_per_seq,
        jnp.dtype(kv_cache.dtype).itemsize,
    )
    rows = rows_per_tile or d_rows
    ppb = num_kv_pages_per_block or d_ppb
    splits = num_kv_splits or d_splits
    if rows & (rows - 1) or head_dim & (head_dim - 1) or (ppb * page_size) & (ppb * page_size - 1):
        raise ValueError("rows_per_tile, head_dim and pages_per_block*page_size must be powers of 2")

    if new_kv is not None:
        kv_cache = write_kv_stacked(kv_cache, layer, new_kv, kv_lens, page_indices, cu_q_lens, num_seqs)

    num_tiles = _max_tiles(num_tokens, group, rows, num_slots)
    tile_seq, tile_row0, tile_base = _tile_tables(cu_q_lens, num_seqs, group, rows, num_tiles)
    # Pad the page table to whole KV blocks so a block's page lookups stay in bounds.
    pps_padded = pl.cdiv(pages_per_seq, ppb) * ppb
    page_table = jnp.pad(page_indices, ((0, 0), (0, pps_padded - pages_per_seq))).reshape(-1)
    # [T, Hq, D] -> [Hkv, T*G + R, D]; the R padding rows keep every tile's load in bounds.
    q = queries.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q = q.reshape(num_kv_heads, num_tokens * group, head_dim)
    q = jnp.pad(q, ((0, 0), (0, rows), (0, 0)))
    kv_flat = kv_cache.reshape(-1, head_dim)

    kernel = functools.partial(
        _kernel,
        has_sinks=sinks is not None,
        rows=rows,
        group=group,
        page_size=page_size,
        num_pages=num_pages,
        num_combined=num_combined,
        pages_per_seq=pps_padded,
        pages_per_block=ppb,
        num_splits=splits,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        mask_value=mask_value,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    grid = (num_tiles, num_kv_heads, splits)
    o_block = pl.BlockSpec((None, None, None, rows, head_dim), lambda t, h, k: (t, h, k, 0, 0))
    stat_block = pl.BlockSpec((None, None, None, rows), lambda t, h, k: (t, h, k, 0))
    o_dtype = queries.dtype if splits == 1 else jnp.float32
    out_shape = [jax.ShapeDtypeStruct((num_tiles, num_kv_heads, splits, rows, head_dim), o_dtype)]
    out_specs = [o_block]
    if splits > 1:
        stats = jax.ShapeDtypeStruct((num_tiles, num_kv_heads, splits, rows), jnp.float32)
        out_shape += [stats, stats]
        out_specs += [stat_block] * 2
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu  # GPU-only import

        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    results = pl.pallas_call(  # no in_specs: every input is passed whole and indexed in-kernel
        kernel,
        grid=grid,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name=f"ragged_paged_attention_gpu_r{rows}_p{ppb}_k{splits}",
    )(
        tile_seq,
        tile_row0,
        kv_lens,
        cu_q_lens,
        page_table,
        jnp.asarray(layer, jnp.int32).reshape(1),
        q,
        kv_flat,
        *(() if sinks is None else (sink_array(sinks, num_q_heads),)),
    )

    if splits == 1:
        o = results[0][:, :, 0].astype(jnp.float32)  # [NT, Hkv, R, D], normalised
    else:
        o, m, l = results
        m_max = jnp.max(m, axis=2, keepdims=True)
        w = jnp.where(l > 0.0, jnp.exp(m - m_max), 0.0)  # [NT, Hkv, K, R]
        l_tot = jnp.sum(l * w, axis=2)
        o = jnp.sum(o * w[..., None], axis=2) / jnp.where(l_tot > 0.0, l_tot, 1.0)[..., None]

    # Tile rows -> tokens: row t*G + g of sequence s sits in tile base[s] + (row - cu[s]*G) // R.
    seq, _, valid = token_sequence_info(kv_lens, cu_q_lens, num_seqs, num_tokens)
    row = (
        jnp.arange(num_tokens, dtype=jnp.int32)[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]
    )  # [T, G]
    rel = row - cu_q_lens[seq][:, None] * group
    tile = jnp.clip(tile_base[seq][:, None] + rel // rows, 0, num_tiles - 1)
    flat = (tile * rows + rel % rows).reshape(-1)
    o = o.transpose(0, 2, 1, 3).reshape(num_tiles * rows, num_kv_heads, head_dim)[flat]
    o = o.reshape(num_tokens, group, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    o = jnp.where(valid[:, None, None, None], o, 0.0).reshape(num_tokens, num_q_heads, head_dim)
    return o.astype(queries.dtype), kv_cache


def ragged_paged_attention_gpu(
    queries,
    new_kv,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    **kwargs,
):
    """Single-layer form: kv_pages [P, page_size, 2*Hkv, D]. Returns (out [T, Hq, D], kv_pages).

    Keyword arguments as in ``ragged_paged_attention_gpu_stacked``.
    """
    out, kv_cache = ragged_paged_attention_gpu_stacked(
        queries, new_kv, kv_pages[None], jnp.int32(0), kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs
    )
    return out, kv_cache[0]

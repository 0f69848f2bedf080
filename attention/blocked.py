"""Ragged paged attention in plain jnp, blocked over KV pages with an online softmax.

This is the implementation ``auto`` picks on CPU (no Pallas kernel runs natively there). It computes
the same function as ``attention/reference.py`` (same signature and shapes, see that module), but
is shaped for XLA:CPU:

* The reference gathers each token's *whole* page row ([T, pages_per_seq * page_size, 2*Hkv, D]),
  so its cost follows the page bucket, not the live context, and the gathered block overflows
  the CPU caches once T * context grows (a 32-sequence decode at a 256-token bucket moves ~25 MB per
  layer).
* Here a ``lax.fori_loop`` walks the KV in blocks of ``pages_per_block`` pages, keeping a running
  max / denominator / accumulator per query (flash-attention style). The trip count comes from
  the queries' positions at run time (a query sees keys up to its own position), so padded
  page-table columns cost nothing, and one block's gather stays cache-sized. The last stretch of a
  row's keys goes in narrower blocks (``TAIL_KV_TOKENS``), so a short remainder is not scored in a
  mostly masked wide block.
* With a sliding window the loop starts at the first block any query can still see.

Two ways to feed a block to the queries:

* per row, for sequences of at most SHORT_QUERY_LEN query rows (decodes, short verifications): their
  rows are packed into min(T, S * SHORT_QUERY_LEN) slots and each gathers its own sequence's pages
  ([rows, block, 2*Hkv, D]);
* per tile, for longer sequences (prefill chunks): the rows go in tiles of QUERY_TILES rows that never
  cross a sequence; a tile gathers its sequence's KV block once and scores all its rows with one
  batched matmul per KV head, in a loop over the live tiles only. Gathering a 250-token prefill's KV
  once per row cost ~60% of that step; tiles that could span several short chunks fell back to that.

Before both, a shared-prefix pass (cascade attention): the leading pages every sequence of the step
shares (prefix caching hands requests with one system prompt the same pages) are gathered once per
block and attended by all rows in one matmul per KV head; the two paths above then cover only what
follows the prefix, and the results merge by their softmax denominators. Attention sinks join the
same way, last: a key set with the sink as its log-denominator and no value, once per row. Four decodes over a shared
1.4k-token prompt read its KV once instead of four times (attention ~50 -> ~30 ms over 30 layers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from tpuserve.attention.reference import gather_pages, sink_array, token_sequence_info

# Elements of gathered KV one loop iteration may hold: ~2 MiB of f32, inside a core's L2/L3 share.
_BLOCK_BUDGET = 512 * 1024


# Score elements one block of the shared-prefix pass may hold (2 MiB of f32).
_SCORE_BUDGET = 512 * 1024


# Sequences with more query rows than this go in tiles (prefill chunks); the others per row.
SHORT_QUERY_LEN = 4
# Query rows per tile (a tile never spans two sequences), largest first. Big tiles run the score
# matmuls more efficiently; small ones waste less on a chunk's remainder (a 30-token chunk in a
# 64-row tile cost ~1.7x its 32-row tile). Each size is one more loop per layer to compile: the
# attention of a 30-layer program compiles in ~15 s with three sizes, ~11 s with two.
QUERY_TILES = (64, 32, 16)
# KV tokens per loop iteration of a tile (one sequence's pages, gathered once for the tile's rows).
TILE_KV_TOKENS = 512
# KV tokens per iteration over the last, partial stretch of a row's or tile's keys. After a cached
# shared prefix a sequence's own keys are often ~100 tokens; scoring them in one 512-key block wasted
# most of a chunk's tile work (4 x 72-token chunks after a shared 1.4k prompt: ~540 -> ~415 ms of
# attention over 30 layers), while long contexts still go in the wide blocks.
TAIL_KV_TOKENS = 128


@dataclass(frozen=True)
class _Ctx:
    """What every row of a step shares: the cache, its table and the attention options."""

    kv_pages: jax.Array
    layer: jax.Array | None
    table: jax.Array  # [S, pages padded to whole blocks]
    page_size: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    soft_cap: float | None
    k_scale: float | None
    v_scale: float | None
    kv_dtype: jnp.dtype | None  # the values' dtype when a uint8 cache holds their bytes

    def gather(self, pages):
        """pages [..., n] -> (k, v) [..., n * page_size, Hkv, D] f32, scaled."""
        kv = gather_pages(self.kv_pages, pages, self.layer, self.kv_dtype)
        kv = kv.reshape(
            *pages.shape[:-1], pages.shape[-1] * self.page_size, self.num_kv_heads, 2, self.head_dim
        ).astype(jnp.float32)
        k, v = kv[..., 0, :], kv[..., 1, :]
        if self.k_scale is not None:
            k = k * self.k_scale
        if self.v_scale is not None:
            v = v * self.v_scale
        return k, v

    def mask(self, kv_pos, q_pos):
        """Causal (+ window) visibility [rows, keys] of keys at kv_pos [keys] to queries at q_pos [rows]."""
        visible = kv_pos[None, :] <= q_pos[:, None]
        if self.sliding_window is not None:
            visible &= kv_pos[None, :] > q_pos[:, None] - self.sliding_window
        return visible

    def key_span(self, q_pos, valid):
        """[first, end) of the key positions any valid row can see (a row sees keys up to its own
        position; with a window, not before it)."""
        end = jnp.max(jnp.where(valid, q_pos + 1, 0))
        first = jnp.int32(0)
        if self.sliding_window is not None:
            first = jnp.min(jnp.where(valid, q_pos - self.sliding_window + 1, jnp.iinfo(jnp.int32).max))
            first = jnp.clip(first, 0, end)
        return first, end


def _stages(first, end, wide_pages: int, tail_pages: int, page_size: int, block_scores_for):
    """Loops covering keys [first, end): blocks of ``wide_pages`` pages while whole ones fit before
    ``end``, then blocks of ``tail_pages`` (which divides wide_pages) for the rest, unless the rest
    fills over half a wide block (one more wide block wastes less than the narrow ones cost: their
    smaller matmuls run slower per key). block_scores_for(n) -> block_scores(j) for blocks of n pages
    (keys j * n * page_size onward). Returns [(start, stop, block_scores)] for ``_online_softmax_loop``."""
    wide, tail = wide_pages * page_size, tail_pages * page_size
    if tail_pages >= wide_pages:
        return [(first // wide, (end + wide - 1) // wide, block_scores_for(wide_pages))]
    wide_stop = (end + wide // 2) // wide
    tail_start = jnp.maximum(wide_stop * wide, first // tail * tail) // tail
    return [
        (first // wide, wide_stop, block_scores_for(wide_pages)),
        (tail_start, (end + tail - 1) // tail, block_scores_for(tail_pages)),
    ]


def _online_softmax_loop(q, stages):
    """Run the flash-attention recurrence over KV blocks, one loop per stage.

    q [..., D] (any leading query dims N); stages [(start, stop, block_scores)], each looping j over
    start..stop-1, with block_scores(j) -> (scores [N..., C] with -inf where hidden, pv) where
    pv(probs [N..., C]) -> [N..., D] is that block's probs @ V (C may differ between stages). Returns
    (out [N..., D] (0 for queries that saw nothing), lse [N...]: log of the softmax denominator, -inf
    where nothing was seen), so that attention over two disjoint key sets can be merged (``_merge``).
    """
    lead, d = q.shape[:-1], q.shape[-1]

    def step_with(block_scores):
        def step(j, carry):
            run_max, denom, acc = carry
            scores, pv = block_scores(j)
            new_max = jnp.maximum(run_max, scores.max(axis=-1))
            # A row with nothing visible yet keeps max -inf; shift by 0 there so exp() gives 0, not NaN.
            shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            probs = jnp.exp(scores - shift[..., None])
            rescale = jnp.exp(run_max - shift)
            denom = denom * rescale + probs.sum(axis=-1)
            acc = acc * rescale[..., None] + pv(probs)
            return new_max, denom, acc

        return step

    carry = (
        jnp.full(lead, -jnp.inf, jnp.float32),
        jnp.zeros(lead, jnp.float32),
        jnp.zeros((*lead, d), jnp.float32),
    )
    for start, stop, block_scores in stages:
        carry = jax.lax.fori_loop(start, stop, step_with(block_scores), carry)
    run_max, denom, acc = carry
    seen = denom > 0
    lse = jnp.where(seen, run_max + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
    return acc / jnp.where(seen, denom, 1.0)[..., None], lse


def _merge(out_a, lse_a, out_b, lse_b):
    """Softmax attention over key sets A and B from each one's (out [..., D], lse [...])."""
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w_a, w_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = w_a + w_b
    return (out_a * w_a[..., None] + out_b * w_b[..., None]) / jnp.where(total > 0, total, 1.0)[..., None]


def _cap(ctx: _Ctx, scores):
    return scores if ctx.soft_cap is None else ctx.soft_cap * jnp.tanh(scores / ctx.soft_cap)


def _attend_rows(ctx: _Ctx, q, seq, q_pos, valid, pages_per_block: int, tail_pages: int):
    """Every row gathers its own sequence's KV blocks (any mix of sequences). q [R, Hkv, G, D]."""
    row_pages = ctx.table[seq]  # [R, padded pages]

    def block_scores_for(n: int):
        block = n * ctx.page_size
        offsets = jnp.arange(block, dtype=jnp.int32)

        def block_scores(j):
            pages = jax.lax.dynamic_slice_in_dim(row_pages, j * n, n, axis=1)
            k, v = ctx.gather(pages)  # [R, C, Hkv, D]
            scores = _cap(ctx, jnp.einsum("rhgd,rchd->rhgc", q, k))
            visible = ctx.mask(j * block + offsets, q_pos) & valid[:, None]
            scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
            return scores, lambda probs: jnp.einsum("rhgc,rchd->rhgd", probs, v)

        return block_scores

    first, end = ctx.key_span(q_pos, valid)
    return _online_softmax_loop(
        q, _stages(first, end, pages_per_block, tail_pages, ctx.page_size, block_scores_for)
    )


def _attend_sequence_tiles(
    ctx: _Ctx,
    q,
    out,
    lse,
    kv_lens,
    cu_q_lens,
    q_lens,
    tiled,
    kv_pages_per_block: int,
    tail_pages: int,
    tile_sizes: tuple[int, ...],
):
    """Queries of the ``tiled`` sequences, in tiles that never cross a sequence, written into ``out``
    and ``lse`` [T, Hkv, G] (returned).

    Each tile gathers its sequence's KV blocks once and scores all its rows with one batched matmul
    per KV head. A sequence's rows go in tiles of tile_sizes[0] (descending) while more than half a
    tile is left, then likewise down to the smallest size, which takes the rest. Each size is one
    loop over the live tiles only (a dynamic trip count). q, out [T, Hkv, G, D]; q_lens [S];
    tiled [S] bool.
    """
    num_tokens, hkv, group, d = q.shape
    biggest = max(tile_sizes)
    # Room for a tile starting at the last row: slices never clamp (a clamped start would shift rows).
    pad = [(0, biggest)] + [(0, 0)] * 3
    q_pad, out, lse = jnp.pad(q, pad), jnp.pad(out, pad), jnp.pad(lse, pad[:3])
    covered = jnp.zeros_like(q_lens)  # rows of each sequence already given to bigger tiles
    for n, size in enumerate(tile_sizes):
        # Tiles of this size while more than half of one is left (a partial one wastes under half
        # its rows); the smallest size takes all the rest.
        keep = size // 2 if n + 1 < len(tile_sizes) else 0
        tiles_per_seq = jnp.where(tiled, jnp.maximum(0, -(-(q_lens - covered - keep) // size)), 0)
        tile_ends = jnp.cumsum(tiles_per_seq)
        rows = jnp.arange(size, dtype=jnp.int32)

        # fori_loop traces one_tile right here, so it sees this iteration's size and counts.
        def one_tile(i, carry):
            out, lse = carry
            s = jnp.searchsorted(tile_ends, i, side="right").astype(jnp.int32)
            first = covered[s] + (i - (tile_ends[s] - tiles_per_seq[s])) * size  # within the sequence
            row0 = cu_q_lens[s] + first
            live = rows < q_lens[s] - first
            q_pos = kv_lens[s] - q_lens[s] + first + rows
            tq = jax.lax.dynamic_slice_in_dim(q_pad, row0, size)
            # Head-major [Hkv, size * G, D]: both matmuls become plain batched GEMMs per KV head
            # (the row-major einsum of probs @ V ran ~2x slower on XLA:CPU).
            tq = tq.transpose(1, 0, 2, 3).reshape(hkv, size * group, d)
            seq_pages = ctx.table[s]

            def block_scores_for(n: int):
                block = n * ctx.page_size
                offsets = jnp.arange(block, dtype=jnp.int32)

                def block_scores(j):
                    pages = jax.lax.dynamic_slice_in_dim(seq_pages, j * n, n)
                    k_blk, v_blk = ctx.gather(pages)  # [C, Hkv, D]
                    k_blk, v_blk = k_blk.transpose(1, 0, 2), v_blk.transpose(1, 0, 2)
                    scores = _cap(ctx, jnp.einsum("hmd,hcd->hmc", tq, k_blk))
                    visible = ctx.mask(j * block + offsets, q_pos) & live[:, None]  # [size, C]
                    visible = jnp.repeat(visible, group, axis=0)
                    scores = jnp.where(visible[None], scores, -jnp.inf)
                    return scores, lambda probs: jnp.einsum("hmc,hcd->hmd", probs, v_blk)

                return block_scores

            first, end = ctx.key_span(q_pos, live)
            res, res_lse = _online_softmax_loop(
                tq, _stages(first, end, kv_pages_per_block, tail_pages, ctx.page_size, block_scores_for)
            )
            res = res.reshape(hkv, size, group, d).transpose(1, 0, 2, 3)
            res_lse = res_lse.reshape(hkv, size, group).transpose(1, 0, 2)
            # A partial tile's spare rows belong to the next sequence (any path, any loop): keep them.
            res = jnp.where(live[:, None, None, None], res, jax.lax.dynamic_slice_in_dim(out, row0, size))
            res_lse = jnp.where(live[:, None, None], res_lse, jax.lax.dynamic_slice_in_dim(lse, row0, size))
            return (
                jax.lax.dynamic_update_slice_in_dim(out, res, row0, axis=0),
                jax.lax.dynamic_update_slice_in_dim(lse, res_lse, row0, axis=0),
            )

        out, lse = jax.lax.fori_loop(0, tile_ends[-1], one_tile, (out, lse))
        covered = covered + tiles_per_seq * size
    return out[:num_tokens], lse[:num_tokens]


def common_prefix_pages(kv_lens, page_indices, cu_q_lens, num_seqs, page_size: int):
    """Leading pages every live sequence shares (same page ids) and all of whose tokens lie before
    every live sequence's first query: a prefix each query sees whole. [S, W] table -> int32 scalar."""
    num_slots = kv_lens.shape[0]
    live = jnp.arange(num_slots) < num_seqs[0]
    same = jnp.all((page_indices == page_indices[0]) | ~live[:, None], axis=0)
    shared = jnp.sum(jnp.cumprod(same.astype(jnp.int32)))
    first_query = kv_lens - (cu_q_lens[1:] - cu_q_lens[:-1])
    before_all = jnp.min(jnp.where(live, first_query, jnp.iinfo(jnp.int32).max)) // page_size
    return jnp.where(num_seqs[0] > 0, jnp.minimum(shared, before_all), 0).astype(jnp.int32)


def _attend_common_prefix(ctx: _Ctx, q, valid, num_pages, pages_per_block: int):
    """Every row against the first ``num_pages`` pages of table row 0, which all live sequences share
    and every query sees whole (no causal mask): the shared KV is gathered once per block for all
    rows, and the score matmuls have all the step's rows (cascade attention). q [T, Hkv, G, D];
    returns out [T, Hkv, G, D] and lse [T, Hkv, G] (-inf for padding rows)."""
    num_tokens, hkv, group, d = q.shape
    block = pages_per_block * ctx.page_size
    qh = q.transpose(1, 0, 2, 3).reshape(hkv, num_tokens * group, d)
    offsets = jnp.arange(block, dtype=jnp.int32)
    num_keys = num_pages * ctx.page_size
    rows_valid = jnp.repeat(valid, group)

    def block_scores(j):
        pages = jax.lax.dynamic_slice_in_dim(ctx.table[0], j * pages_per_block, pages_per_block)
        k, v = ctx.gather(pages)  # [C, Hkv, D]
        k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
        scores = _cap(ctx, jnp.einsum("hmd,hcd->hmc", qh, k))
        visible = (j * block + offsets < num_keys)[None, :] & rows_valid[:, None]  # [T * G, C]
        scores = jnp.where(visible[None], scores, -jnp.inf)
        return scores, lambda probs: jnp.einsum("hmc,hcd->hmd", probs, v)

    stop = (num_pages + pages_per_block - 1) // pages_per_block
    out, lse = _online_softmax_loop(qh, [(jnp.int32(0), stop, block_scores)])
    return (
        out.reshape(hkv, num_tokens, group, d).transpose(1, 0, 2, 3),
        lse.reshape(hkv, num_tokens, group).transpose(1, 0, 2),
    )


def _attend_short_rows(ctx: _Ctx, q, seq, q_pos, short, max_rows: int, pages_per_block: int, tail_pages: int):
    """Rows flagged ``short`` (decodes and other few-token queries), gathered into ``max_rows``
    slots, each attending through its own sequence's pages. Returns out [T, Hkv, G, D] and
    lse [T, Hkv, G] (others 0 and -inf)."""
    num_tokens = q.shape[0]
    # Slot num_tokens is a padding row (index past the real ones; dropped on the way back).
    idx = jnp.nonzero(short, size=max_rows, fill_value=num_tokens)[0]

    def pad(x, fill):
        return jnp.concatenate([x, jnp.full((1,) + x.shape[1:], fill, x.dtype)])

    res, res_lse = _attend_rows(
        ctx,
        pad(q, 0.0)[idx],
        pad(seq, 0)[idx],
        pad(q_pos, 0)[idx],
        pad(short, False)[idx],
        pages_per_block,
        tail_pages,
    )
    return (
        jnp.zeros_like(q).at[idx].set(res, mode="drop"),
        jnp.full(q.shape[:-1], -jnp.inf, jnp.float32).at[idx].set(res_lse, mode="drop"),
    )


def prefix_pages_per_block(num_tokens: int, num_q_heads: int, page_size: int, pages_per_seq: int) -> int:
    """Pages per loop iteration of the shared-prefix pass: its scores [Hq, T, block] fit
    ``_SCORE_BUDGET`` elements, and a block is at most TILE_KV_TOKENS keys (the last one is partial)."""
    by_scores = _SCORE_BUDGET // max(1, num_tokens * num_q_heads * page_size)
    return max(1, min(pages_per_seq, TILE_KV_TOKENS // page_size, by_scores))


def default_pages_per_block(
    num_tokens: int, page_size: int, num_combined: int, head_dim: int, pages_per_seq: int
) -> int:
    """Pages per loop iteration so that one block's gather fits ``_BLOCK_BUDGET`` elements."""
    per_page = num_tokens * page_size * num_combined * head_dim
    return max(1, min(pages_per_seq, _BLOCK_BUDGET // max(1, per_page)))


def ragged_paged_attention_blocked(
    queries,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    layer=None,
    pages_per_block: int | None = None,
    tile_kv_pages: int | None = None,
    tail_kv_pages: int | None = None,
    cascade: bool = True,
    kv_dtype=None,
    sinks=None,
):
    """Causal attention of ragged queries over paged KV. Returns [T, Hq, D] in queries.dtype.

    Shapes as in attention/reference.py; with ``layer`` (a scalar) kv_pages is the stacked
    [L, P, page_size, 2*Hkv, D] cache; ``kv_dtype`` as there (a uint8 cache of fp8 bytes). Padding
    tokens (past cu_q_lens[num_seqs]) produce zeros. ``sinks``: None, or f32 [Hq] attention-sink
    logits as in the reference (in each row's denominator, no value, not scaled or capped).
    ``cascade``: attend the leading pages every sequence shares in one pass for all rows
    (``common_prefix_pages``; found at run time, so a step without one pays only an empty loop).
    Blocks (pages per loop iteration): ``pages_per_block`` for the per-row path, ``tile_kv_pages`` for
    tiles, each used while whole blocks fit below the keys a row or tile sees, then blocks of
    ``tail_kv_pages`` for the rest (the wide sizes round down to multiples of it).
    """
    num_tokens, num_q_heads, head_dim = queries.shape
    page_size, num_combined = kv_pages.shape[-3:-1]
    num_kv_heads = num_combined // 2
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    num_slots = kv_lens.shape[0]
    # Few-token sequences go per row; their rows fit in this many slots.
    max_short_rows = min(num_tokens, num_slots * SHORT_QUERY_LEN)
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(
            max_short_rows, page_size, num_combined, head_dim, page_indices.shape[1]
        )
    if tile_kv_pages is None:
        tile_kv_pages = max(1, TILE_KV_TOKENS // page_size)
    if tail_kv_pages is None:
        tail_kv_pages = max(1, TAIL_KV_TOKENS // page_size)

    def with_tail(wide: int):
        # (wide, tail) with tail dividing wide (both stages index the same padded table).
        tail = min(wide, tail_kv_pages)
        return wide // tail * tail, tail

    pages_per_block, row_tail = with_tail(pages_per_block)
    tile_kv_pages, tile_tail = with_tail(tile_kv_pages)

    def padded_table(pages: int):
        # Whole blocks; the extra columns point at page 0 and are masked by position.
        return jnp.pad(page_indices, ((0, 0), (0, -page_indices.shape[1] % pages)))

    q = queries.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    ctx = _Ctx(
        kv_pages=kv_pages,
        layer=layer,
        table=page_indices,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_dtype=None if kv_dtype is None else jnp.dtype(kv_dtype),
    )
    prefix = None
    if cascade and sliding_window is None:
        # Pages all sequences share (a common system prompt) are attended once for every row; the
        # per-sequence passes below then see only what follows, through tables and lengths shifted
        # past the prefix (positions become relative to its end; causality is unchanged).
        shared = common_prefix_pages(kv_lens, page_indices, cu_q_lens, num_seqs, page_size)
        block = prefix_pages_per_block(num_tokens, num_q_heads, page_size, page_indices.shape[1])
        real = jnp.arange(num_tokens) < cu_q_lens[num_seqs[0]]
        prefix = _attend_common_prefix(
            dataclasses.replace(ctx, table=padded_table(block)), q, real, shared, block
        )
        width = page_indices.shape[1]
        page_indices = jax.lax.dynamic_slice_in_dim(
            jnp.pad(page_indices, ((0, 0), (0, width))), shared, width, axis=1
        )
        kv_lens = jnp.maximum(kv_lens - shared * page_size, 0)
    seq, q_pos, valid = token_sequence_info(kv_lens, cu_q_lens, num_seqs, num_tokens)
    ctx = dataclasses.replace(ctx, table=padded_table(pages_per_block))
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    live_slot = jnp.arange(num_slots) < num_seqs[0]
    tiled = live_slot & (q_lens > SHORT_QUERY_LEN)
    out, lse = _attend_short_rows(
        ctx, q, seq, q_pos, valid & ~tiled[seq], max_short_rows, pages_per_block, row_tail
    )
    if num_tokens > SHORT_QUERY_LEN:  # else no sequence can be long enough to tile
        tile_ctx = dataclasses.replace(ctx, table=padded_table(tile_kv_pages))
        sizes = tuple(t for t in QUERY_TILES if t <= num_tokens) or (min(QUERY_TILES),)
        out, lse = _attend_sequence_tiles(
            tile_ctx, q, out, lse, kv_lens, cu_q_lens, q_lens, tiled, tile_kv_pages, tile_tail, sizes
        )
    if prefix is not None:
        out_all = _merge(out, lse, *prefix)
        if sinks is not None:  # the sink below needs the denominator over both key sets
            lse = jnp.logaddexp(lse, prefix[1])
        out = out_all
    if sinks is not None:
        # Merged last, so once per row whichever passes covered its keys: a sink is a key set whose
        # lse is the sink logit and whose value is 0. Padding rows (lse -inf) stay 0.
        sink_lse = jnp.broadcast_to(sink_array(sinks, num_q_heads).reshape(num_kv_heads, group), lse.shape)
        out = _merge(out, lse, jnp.zeros_like(out), sink_lse)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(queries.dtype)

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
  page-table columns cost nothing, and one block's gather stays cache-sized.
* With a sliding window the loop starts at the first block any query can still see.

Two ways to feed a block to the queries:

* per row: every query row gathers its own sequence's pages ([T, block, 2*Hkv, D]) - what a run of
  decodes needs (each row is its own sequence), used for steps of fewer than QUERY_TILE tokens;
* per tile, for steps of QUERY_TILE tokens or more: the rows go in tiles of QUERY_TILE; a tile whose
  rows come from at most two sequences (the inside of prefill chunks) gathers those two sequences'
  block once and scores all its rows with one batched matmul per KV head, masking rows against the
  other sequence's keys. Other tiles fall back to per-row gathers (``lax.cond`` per tile). Gathering a
  250-token prefill's KV once per row cost ~60% of that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from tpuserve.attention.reference import token_sequence_info

# Elements of gathered KV one loop iteration may hold: ~2 MiB of f32, inside a core's L2/L3 share.
_BLOCK_BUDGET = 512 * 1024


# Query rows per tile on the prefill path (steps of at least this many tokens are tiled).
QUERY_TILE = 64
# KV tokens per block on the prefill path (its gather is two sequences' blocks, not one per row).
TILE_KV_TOKENS = 64


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

    def gather(self, pages):
        """pages [..., n] -> (k, v) [..., n * page_size, Hkv, D] f32, scaled."""
        kv = self.kv_pages[pages] if self.layer is None else self.kv_pages[self.layer, pages]
        kv = kv.reshape(*pages.shape[:-1], pages.shape[-1] * self.page_size, self.num_kv_heads, 2,
                        self.head_dim).astype(jnp.float32)
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

    def block_range(self, q_pos, valid, block: int):
        """[start, stop) of the KV blocks any valid row can see (a row sees keys up to its own position)."""
        stop = (jnp.max(jnp.where(valid, q_pos + 1, 0)) + block - 1) // block
        start = jnp.int32(0)
        if self.sliding_window is not None:
            first = jnp.min(jnp.where(valid, q_pos - self.sliding_window + 1, jnp.iinfo(jnp.int32).max))
            start = jnp.clip(first, 0, None) // block
        return start, stop


def _online_softmax_loop(ctx: _Ctx, q, start, stop, block_scores):
    """Run the flash-attention recurrence over KV blocks start..stop-1.

    q [R, Hkv, G, D]; block_scores(j) -> (scores [R, Hkv, G, C] with -inf where hidden, pv) where
    pv(probs [R, Hkv, G, C]) -> [R, Hkv, G, D] is that block's probs @ V. Returns out [R, Hkv, G, D]
    (0 for rows that saw nothing).
    """
    rows, hkv, group, d = q.shape

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

    init = (jnp.full((rows, hkv, group), -jnp.inf, jnp.float32),
            jnp.zeros((rows, hkv, group), jnp.float32),
            jnp.zeros((rows, hkv, group, d), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(start, stop, step, init)
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]


def _cap(ctx: _Ctx, scores):
    return scores if ctx.soft_cap is None else ctx.soft_cap * jnp.tanh(scores / ctx.soft_cap)


def _attend_rows(ctx: _Ctx, q, seq, q_pos, valid, pages_per_block: int):
    """Every row gathers its own sequence's KV blocks (any mix of sequences). q [R, Hkv, G, D]."""
    block = pages_per_block * ctx.page_size
    row_pages = ctx.table[seq]  # [R, padded pages]
    offsets = jnp.arange(block, dtype=jnp.int32)
    start, stop = ctx.block_range(q_pos, valid, block)

    def block_scores(j):
        pages = jax.lax.dynamic_slice_in_dim(row_pages, j * pages_per_block, pages_per_block, axis=1)
        k, v = ctx.gather(pages)  # [R, C, Hkv, D]
        scores = _cap(ctx, jnp.einsum("rhgd,rchd->rhgc", q, k))
        visible = ctx.mask(j * block + offsets, q_pos) & valid[:, None]
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        return scores, lambda probs: jnp.einsum("rhgc,rchd->rhgd", probs, v)

    return _online_softmax_loop(ctx, q, start, stop, block_scores)


def _attend_two_sequences(ctx: _Ctx, q, seq, q_pos, valid, first, last):
    """Rows drawn from at most two sequences (first, last = first or first + 1): the KV blocks of
    both are gathered once for all rows and scored by one batched matmul per head."""
    pages_per_block = max(1, TILE_KV_TOKENS // ctx.page_size)
    pages_per_block = min(pages_per_block, ctx.table.shape[1])
    while ctx.table.shape[1] % pages_per_block:
        pages_per_block -= 1
    block = pages_per_block * ctx.page_size
    pair = jnp.stack([first, last])
    pair_pages = ctx.table[pair]  # [2, padded pages]
    offsets = jnp.arange(block, dtype=jnp.int32)
    # Keys of `last` duplicate `first`'s when both are the same sequence: count them once.
    key_seq = jnp.concatenate([jnp.full((block,), first, jnp.int32),
                               jnp.full((block,), jnp.where(last == first, -1, last), jnp.int32)])
    start, stop = ctx.block_range(q_pos, valid, block)

    def block_scores(j):
        pages = jax.lax.dynamic_slice_in_dim(pair_pages, j * pages_per_block, pages_per_block, axis=1)
        k, v = ctx.gather(pages)  # [2, C, Hkv, D]
        k = k.reshape(2 * block, ctx.num_kv_heads, ctx.head_dim)
        v = v.reshape(2 * block, ctx.num_kv_heads, ctx.head_dim)
        kv_pos = jnp.concatenate([j * block + offsets, j * block + offsets])
        scores = _cap(ctx, jnp.einsum("rhgd,chd->rhgc", q, k))
        visible = ctx.mask(kv_pos, q_pos) & (key_seq[None, :] == seq[:, None]) & valid[:, None]
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        return scores, lambda probs: jnp.einsum("rhgc,chd->rhgd", probs, v)

    return _online_softmax_loop(ctx, q, start, stop, block_scores)


def _attend_tiles(ctx: _Ctx, q, seq, q_pos, valid, pages_per_block: int):
    """Long steps in tiles of QUERY_TILE rows. A tile whose rows come from at most two sequences
    (inside a prefill chunk, or where one chunk ends and the next begins) shares one gather of the
    two sequences' KV; any other tile (runs of decodes) falls back to per-row gathers."""
    num_tokens = q.shape[0]
    pad = -num_tokens % QUERY_TILE
    n = (num_tokens + pad) // QUERY_TILE

    def tiles(x, fill):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(n, QUERY_TILE, *x.shape[1:])

    def one_tile(args):
        tq, tseq, tpos, tvalid = args
        big = jnp.iinfo(jnp.int32).max
        first = jnp.min(jnp.where(tvalid, tseq, big))
        last = jnp.max(jnp.where(tvalid, tseq, -1))
        two = (last >= first) & (last - first <= 1)
        return jax.lax.cond(
            two,
            lambda: _attend_two_sequences(ctx, tq, tseq, tpos, tvalid, first, last),
            lambda: _attend_rows(ctx, tq, tseq, tpos, tvalid, pages_per_block))

    out = jax.lax.map(one_tile, (tiles(q, 0.0), tiles(seq, 0), tiles(q_pos, 0), tiles(valid, False)))
    return out.reshape(n * QUERY_TILE, *q.shape[1:])[:num_tokens]


def default_pages_per_block(num_tokens: int, page_size: int, num_combined: int, head_dim: int,
                            pages_per_seq: int) -> int:
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
):
    """Causal attention of ragged queries over paged KV. Returns [T, Hq, D] in queries.dtype.

    Shapes as in attention/reference.py; with ``layer`` (a scalar) kv_pages is the stacked
    [L, P, page_size, 2*Hkv, D] cache. Padding tokens (past cu_q_lens[num_seqs]) produce zeros.
    """
    num_tokens, num_q_heads, head_dim = queries.shape
    page_size, num_combined = kv_pages.shape[-3:-1]
    num_kv_heads = num_combined // 2
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(num_tokens, page_size, num_combined, head_dim,
                                                  pages_per_seq)
    block = pages_per_block * page_size
    num_blocks_static = -(-pages_per_seq // pages_per_block)
    # Pad the table to whole blocks; the extra columns point at page 0 and are masked by position.
    table = jnp.pad(page_indices, ((0, 0), (0, num_blocks_static * pages_per_block - pages_per_seq)))

    seq, q_pos, valid = token_sequence_info(kv_lens, cu_q_lens, num_seqs, num_tokens)
    q = queries.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    ctx = _Ctx(kv_pages=kv_pages, layer=layer, table=table, page_size=page_size,
               num_kv_heads=num_kv_heads, head_dim=head_dim, sliding_window=sliding_window,
               soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    if num_tokens < QUERY_TILE:
        out = _attend_rows(ctx, q, seq, q_pos, valid, pages_per_block)
    else:
        out = _attend_tiles(ctx, q, seq, q_pos, valid, pages_per_block)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(queries.dtype)

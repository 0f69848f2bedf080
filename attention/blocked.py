"""Ragged paged attention in plain jnp, blocked over KV pages with an online softmax.

This is the implementation ``auto`` picks on CPU (no Pallas kernel runs natively there). It computes
the same function as ``attention/reference.py`` (same signature and shapes, see that module), but
is shaped for XLA:CPU:

* The reference gathers each token's *whole* page row ([T, pages_per_seq * page_size, 2*Hkv, D]),
  so its cost follows the page bucket, not the live context, and the gathered block overflows
  the CPU caches once T * context grows (a 32-sequence decode at a 256-token bucket moves ~25 MB per
  layer).
* Here a ``lax.fori_loop`` walks the KV in blocks of ``pages_per_block`` pages, keeping a running
  max / denominator / accumulator per query (flash-attention style). The trip count is computed
  from the live ``kv_lens`` at run time, so padded page-table columns cost nothing, and one block's
  gather ([T, pages_per_block * page_size, 2*Hkv, D]) stays cache-sized.
* With a sliding window the loop starts at the first block any query can still see.

Every query row still gathers its own sequence's pages (a decode row is its sequence), which is
what a ragged batch needs without data-dependent shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention.reference import token_sequence_info

# Elements of gathered KV one loop iteration may hold: ~2 MiB of f32, inside a core's L2/L3 share.
_BLOCK_BUDGET = 512 * 1024


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
    token_pages = table[seq]  # [T, padded pages]
    live = jnp.arange(kv_lens.shape[0]) < num_seqs[0]
    stop = (jnp.max(jnp.where(live, kv_lens, 0)) + block - 1) // block
    start = jnp.int32(0)
    if sliding_window is not None:
        first_visible = jnp.min(jnp.where(valid, q_pos - sliding_window + 1, jnp.iinfo(jnp.int32).max))
        start = jnp.clip(first_visible, 0, None) // block

    q = queries.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    offsets = jnp.arange(block, dtype=jnp.int32)

    def step(j, carry):
        run_max, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(token_pages, j * pages_per_block, pages_per_block, axis=1)
        kv = kv_pages[pages] if layer is None else kv_pages[layer, pages]
        kv = kv.reshape(num_tokens, block, num_kv_heads, 2, head_dim).astype(jnp.float32)
        k, v = kv[..., 0, :], kv[..., 1, :]
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        scores = jnp.einsum("thgd,tchd->thgc", q, k)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        kv_pos = j * block + offsets
        mask = kv_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
        new_max = jnp.maximum(run_max, scores.max(axis=-1))
        # A row with nothing visible yet keeps max -inf; shift by 0 there so exp() gives 0, not NaN.
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.exp(scores - shift[..., None])
        rescale = jnp.exp(run_max - shift)
        denom = denom * rescale + probs.sum(axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("thgc,tchd->thgd", probs, v)
        return new_max, denom, acc

    init = (jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(start, stop, step, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(queries.dtype)

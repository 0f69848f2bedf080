"""Pure-jnp ragged paged attention: the reference every kernel is checked against.

Shapes (T tokens in the step, S sequence slots, Hq query heads, Hkv KV heads, D head dim, P pages):

    queries       [T, Hq, D]          all scheduled tokens of all sequences, concatenated
    kv_pages      [P, page_size, 2*Hkv, D]   one layer's cache, K/V interleaved (kv_cache/layout.py)
    kv_lens       [S] int32           tokens in each sequence's cache *including* this step's new ones
    page_indices  [S, pages_per_seq] int32   page table rows
    cu_q_lens     [S + 1] int32       prefix sums of per-sequence query lengths
    num_seqs      [1] int32           live sequences; slots >= num_seqs are padding (q_len 0)

A sequence with query length q and kv length n owns query positions n - q .. n - 1: its queries are
the *last* q tokens of its context (prefill chunks and decodes alike). Tokens past
``cu_q_lens[num_seqs]`` are padding and produce zeros.

The signature of ``ragged_paged_attention_ref`` is that of jax's
``jax.experimental.pallas.ops.tpu.ragged_paged_attention.ref_ragged_paged_attention`` so the two can
be compared directly. This version is jittable (no data-dependent Python control flow); it gathers
each token's whole page row (in token tiles, to bound memory), so work grows with
T * pages_per_seq * page_size: the engine keeps ``pages_per_seq`` bucketed to the batch's longest context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Elements of gathered KV one token tile may hold (~64 MiB of f32).
_GATHER_BUDGET = 16 * 1024 * 1024


def token_sequence_info(kv_lens, cu_q_lens, num_seqs, num_tokens: int):
    """Per token: (sequence slot, absolute position, is-real-token). All [T]."""
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    num_slots = kv_lens.shape[0]
    seq = jnp.searchsorted(cu_q_lens[1:], tok, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, num_slots - 1)
    valid = tok < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (tok - cu_q_lens[seq])
    return seq, jnp.where(valid, pos, 0), valid


def write_kv_ref(kv_pages, new_kv, kv_lens, page_indices, cu_q_lens, num_seqs, *, layer=None):
    """Scatter this step's K/V into the cache.

    new_kv: [T, 2*Hkv, D] (interleaved). Padding tokens are dropped. Returns the updated kv_pages.
    With ``layer`` (a scalar), kv_pages is the stacked [L, P, page_size, 2*Hkv, D] cache and only that
    layer is written, in place: no per-layer slice is copied out and back.
    A uint8 cache holds the bytes of 1-byte values (an FP8 cache on XLA:CPU,
    ``kv_cache_shape.kv_storage_dtype``): new_kv's bytes are written, so it must be quantized already.
    """
    num_pages, page_size = kv_pages.shape[-4:-2]
    seq, pos, valid = token_sequence_info(kv_lens, cu_q_lens, num_seqs, new_kv.shape[0])
    page = page_indices[seq, pos // page_size]
    page = jnp.where(valid, page, num_pages)  # out of range -> dropped by the scatter
    index = (page, pos % page_size) if layer is None else (layer, page, pos % page_size)
    new_kv = _as_bytes(new_kv) if kv_pages.dtype == jnp.uint8 else new_kv.astype(kv_pages.dtype)
    if _is_fp8(kv_pages.dtype):
        # XLA:CPU has no 8-bit float scatter: it widens the whole cache to scatter into it (a copy
        # of every page, every layer, every step). The same bytes scattered as uint8 stay in place;
        # the bitcasts around it are free.
        raw = jax.lax.bitcast_convert_type(kv_pages, jnp.uint8)
        raw = raw.at[index].set(jax.lax.bitcast_convert_type(new_kv, jnp.uint8), mode="drop")
        return jax.lax.bitcast_convert_type(raw, kv_pages.dtype)
    return kv_pages.at[index].set(new_kv, mode="drop")


def _is_fp8(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def _as_bytes(values):
    """1-byte values as the uint8 a byte-stored cache holds (a bitcast of the few written rows)."""
    if values.dtype == jnp.uint8:
        return values
    if jnp.dtype(values.dtype).itemsize != 1:
        raise ValueError(f"a uint8 KV cache stores 1-byte values, got {values.dtype} ones")
    return jax.lax.bitcast_convert_type(values, jnp.uint8)


def sink_array(sinks, num_q_heads: int):
    """Attention-sink logits as f32 [Hq], or a ValueError naming the shape they must have."""
    if sinks.shape != (num_q_heads,):
        raise ValueError(f"sinks must be one logit per query head, shape ({num_q_heads},), got {sinks.shape}")
    return sinks.astype(jnp.float32)


def gather_pages(kv_pages, pages, layer=None, kv_dtype=None):
    """``kv_pages[pages]`` (or ``kv_pages[layer, pages]`` of a stacked cache), as ``kv_dtype`` values
    (None: the cache dtype). A uint8 cache holding another 1-byte type's bytes (an FP8 cache on
    XLA:CPU) is gathered as bytes and only the gathered pages are bitcast.

    A cache stored as fp8 itself is read as uint8 on XLA:CPU too: XLA:CPU widens an fp8 gather's
    whole operand, a copy of the entire cache every layer of every step. Elsewhere (a TPU runs an
    fp8 cache on this path) a bitcast of the whole cache may be a copy itself (it was for bf16 ->
    uint16 on a v5e), so the gather stays as it is.
    """
    kv_dtype = kv_pages.dtype if kv_dtype is None else jnp.dtype(kv_dtype)
    if _is_fp8(kv_pages.dtype) and jax.default_backend() == "cpu":
        kv_pages = jax.lax.bitcast_convert_type(kv_pages, jnp.uint8)
    got = kv_pages[pages] if layer is None else kv_pages[layer, pages]
    return got if got.dtype == kv_dtype else jax.lax.bitcast_convert_type(got, kv_dtype)


def ragged_paged_attention_ref(
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
    mask_value: float | None = DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    layer=None,
    kv_dtype=None,
    sinks=None,
):
    """Causal attention of ragged queries over paged KV. Returns [T, Hq, D] in queries.dtype.

    With ``layer`` (a scalar), kv_pages is the stacked [L, P, page_size, 2*Hkv, D] cache.
    ``kv_dtype``: the dtype of the cached values when a uint8 cache holds their bytes (an FP8 cache
    on XLA:CPU); None: the cache's own dtype.
    ``sinks``: None, or f32 [Hq] attention-sink logits (gpt-oss), one per query head in the queries'
    head order: each row's softmax denominator gains exp(sink) for a key with no value. The sink is
    neither scaled by sm_scale nor soft-capped.
    """
    if mask_value is None:
        mask_value = DEFAULT_MASK_VALUE
    num_tokens, num_q_heads, head_dim = queries.shape
    page_size, num_combined = kv_pages.shape[-3:-1]
    num_kv_heads = num_combined // 2
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_indices.shape[1]
    ctx = pages_per_seq * page_size

    seq, q_pos, valid = token_sequence_info(kv_lens, cu_q_lens, num_seqs, num_tokens)
    kv_pos = jnp.arange(ctx, dtype=jnp.int32)
    if sinks is not None:
        sink_logits = sink_array(sinks, num_q_heads).reshape(num_kv_heads, group, 1)

    def attend(q, seq, q_pos):
        """q [t, Hq, D], seq / q_pos [t] -> [t, Hq, D] f32 for a tile of t tokens."""
        t = q.shape[0]
        pages = page_indices[seq]
        kv = gather_pages(kv_pages, pages, layer, kv_dtype).reshape(t, ctx, num_combined, head_dim)
        k = kv[:, :, 0::2, :].astype(jnp.float32)
        v = kv[:, :, 1::2, :].astype(jnp.float32)
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        q = q.astype(jnp.float32).reshape(t, num_kv_heads, group, head_dim)
        scores = jnp.einsum("thgd,tchd->thgc", q, k) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        mask = kv_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        scores = jnp.where(mask[:, None, None, :], scores, mask_value)
        if sinks is None:
            probs = jax.nn.softmax(scores, axis=-1)
        else:
            # The sink as one more key column: it joins the max and the denominator, then is dropped.
            sink = jnp.broadcast_to(sink_logits, (t, num_kv_heads, group, 1))
            probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
        return jnp.einsum("thgc,tchd->thgd", probs, v).reshape(t, num_q_heads, head_dim)

    # Gathering a page row per token costs t * ctx memory: bound it by mapping over token tiles.
    tile = max(1, min(num_tokens, _GATHER_BUDGET // max(1, ctx * num_combined * head_dim)))
    while num_tokens % tile:
        tile -= 1
    if tile == num_tokens:
        out = attend(queries, seq, q_pos)
    else:
        n = num_tokens // tile
        out = jax.lax.map(
            lambda a: attend(*a),
            (queries.reshape(n, tile, num_q_heads, head_dim), seq.reshape(n, tile), q_pos.reshape(n, tile)),
        )
        out = out.reshape(num_tokens, num_q_heads, head_dim)
    out = jnp.where(valid[:, None, None], out, 0.0)
    return out.astype(queries.dtype)

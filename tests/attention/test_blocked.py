"""The blocked jnp path (attention/blocked.py), the CPU default, against the reference and jax's oracle.

Same shared cases as the kernels, at several block sizes (one page per block exercises the online
softmax across many blocks; a block wider than the table exercises the padded columns), plus a
long-context case where most page-table columns are padding and a stacked-cache dispatch check.
"""

from __future__ import annotations

import dataclasses
import functools

import attention_cases as cases  # tests/attention/attention_cases.py
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.attention.blocked import (
    common_prefix_pages,
    default_pages_per_block,
    ragged_paged_attention_blocked,
)
from tpuserve.attention.dispatch import AttentionParams, ragged_paged_attention, resolve_impl, split_kv
from tpuserve.attention.metadata import AttentionMetadata


# One program per shape and option set, shared by every case of that shape: the metadata is an
# argument, as in the engine, not a constant (a program per case cost ~15% of this file's time).
@functools.partial(jax.jit, static_argnames=("options",))
def _blocked(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, options):
    return ragged_paged_attention_blocked(
        queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **dict(options)
    )


def check(case, kwargs, dtype, pages_per_block, tile_kv_pages=None, tail_kv_pages=None):
    want, kv = cases.expected(case, **kwargs)
    options = dict(
        kwargs, pages_per_block=pages_per_block, tile_kv_pages=tile_kv_pages, tail_kv_pages=tail_kv_pages
    )
    out = _blocked(case.queries, kv, *case.metadata, tuple(sorted(options.items())))
    n = case.num_real_tokens
    np.testing.assert_allclose(cases.f32(out), cases.f32(want), **cases.tolerance(dtype))
    np.testing.assert_allclose(
        cases.f32(out[:n]), cases.f32(cases.oracle(case, kv, **kwargs)), **cases.tolerance(dtype)
    )
    assert not np.any(cases.f32(out[n:]))  # padding tokens are zeros


# (pages_per_block, tail_kv_pages): one page per block; two; wider than the table; blocks of four
# pages while over half of one remains, then one-page blocks (both loops of a row's keys run).
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "blocks",
    [(1, None), (2, None), (8, None), (4, 1)],
    ids=lambda b: f"{b[0]}pages" + (f"-tail{b[1]}" if b[1] else ""),
)
@pytest.mark.parametrize("name", list(cases.CASES))
def test_blocked_matches_reference_and_oracle(name, blocks):
    case, kwargs, dtype = cases.build(name)
    check(case, kwargs, dtype, blocks[0], tail_kv_pages=blocks[1])


@pytest.mark.timeout(180)
def test_blocked_window_and_cap_together():
    case, _, dtype = cases.build("window_g8", seed=1)
    check(case, dict(sm_scale=0.3, sliding_window=3, soft_cap=4.0), dtype, pages_per_block=1)


@pytest.mark.timeout(180)
def test_blocked_long_table_short_contexts():
    """64-page table, contexts of 1..70 tokens: the loop stops at the longest live context."""
    seqs = [(1, 70), (3, 3), (1, 1), (9, 40)]
    case = cases.make_case(
        5,
        seqs,
        num_slots=6,
        page_size=4,
        pages_per_seq=64,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        num_tokens=16,
    )
    check(case, dict(sm_scale=0.125), jnp.float32, pages_per_block=3)
    check(case, dict(sm_scale=0.125, sliding_window=7), jnp.float32, pages_per_block=2)


def test_default_pages_per_block():
    # One decode token, 16-token pages, 3 KV heads of 64: a 512K-element budget -> 85 pages,
    # capped at the table width.
    assert default_pages_per_block(1, 16, 6, 64, 32) == 32
    assert default_pages_per_block(32, 16, 6, 64, 32) == 2  # 196,608 elements a page
    assert default_pages_per_block(256, 16, 6, 64, 32) == 1  # never below one page


def test_auto_is_blocked_on_cpu():
    assert resolve_impl("auto", "cpu") == "blocked"
    assert resolve_impl("auto", "tpu") == "pallas_tpu"
    assert resolve_impl("auto", "gpu") == "pallas_gpu"


def test_a_byte_cache_on_tpu_runs_the_kernel():
    # The compiled kernel decodes FP8 codes in VMEM (attention/pallas_tpu.py): "auto" takes it on
    # a TPU whatever the cache dtype, and the reference asked for by name still runs.
    assert resolve_impl("auto", "tpu", jnp.float8_e4m3fn) == "pallas_tpu"
    assert resolve_impl("pallas_tpu", "tpu", jnp.float8_e4m3fn) == "pallas_tpu"
    assert resolve_impl("reference", "tpu", jnp.float8_e4m3fn) == "reference"
    assert resolve_impl("auto", "tpu", jnp.bfloat16) == "pallas_tpu"
    assert resolve_impl("auto", "cpu", jnp.float8_e4m3fn) == "blocked"
    assert resolve_impl("pallas_tpu_interpret", "cpu", jnp.float8_e4m3fn) == "pallas_tpu_interpret"


@pytest.mark.timeout(180)
def test_dispatch_blocked_stacked_cache():
    """dispatch 'blocked' on a 2-layer cache under jit == 'reference'; the other layer untouched."""
    case, kwargs, _ = cases.build("mixed_g3_d128", seed=8)
    other = jnp.asarray(np.random.default_rng(9).standard_normal(case.kv_pages.shape), case.kv_pages.dtype)
    cache = jnp.stack([other, case.kv_pages])
    new_k, new_v = split_kv(case.new_kv)
    md = AttentionMetadata(*case.metadata)
    params = AttentionParams(**kwargs)

    def step(impl):
        fn = jax.jit(
            lambda q, k, v, c, layer, md: ragged_paged_attention(q, k, v, c, layer, md, params, impl)
        )
        return fn(case.queries, new_k, new_v, cache, jnp.int32(1), md)

    out, got = step("blocked")
    want_out, want = step("reference")
    np.testing.assert_array_equal(cases.f32(got), cases.f32(want))
    np.testing.assert_array_equal(cases.f32(got[0]), cases.f32(other))
    np.testing.assert_allclose(cases.f32(out), cases.f32(want_out), atol=1e-5, rtol=1e-5)


# Sequences of more than SHORT_QUERY_LEN query rows go in per-sequence tiles of QUERY_TILES rows (a
# partial tile's spare rows overlap the next sequence's); the others go per row. Cases: one chunk over
# tiles of several sizes, a chunk after cached context, decodes before and after prefills, lengths at
# the boundaries (SHORT_QUERY_LEN, +1, tile sizes, +1), a partial 32-row tile spilling into the next
# sequence's partial 64-row tile, and more tiles than T / 16.
LONG_STEPS = {
    "one_long_prefill": [(70, 70)],
    "chunk_after_context": [(45, 61), (1, 9)],
    "decodes_then_prefills": [(1, 5)] * 12 + [(20, 30), (17, 17), (6, 40)],
    "prefills_then_decodes": [(33, 33), (1, 12), (1, 1), (1, 7), (1, 26), (2, 50)],
    "boundary_lengths": [(4, 20), (5, 5), (32, 47), (33, 33), (16, 16), (3, 9), (1, 60)],
    "spill_into_big_tile": [(20, 20), (40, 80)],  # 20 of a 32-row tile, 40 of a 64-row tile
    "many_short_chunks": [(6, 30)] * 7 + [(9, 9), (7, 50)],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(LONG_STEPS))
def test_blocked_long_steps_tiled(name):
    from tpuserve.attention.blocked import QUERY_TILES, SHORT_QUERY_LEN

    assert (SHORT_QUERY_LEN, QUERY_TILES) == (4, (64, 32, 16))  # the cases above are written for these
    seqs = LONG_STEPS[name]
    assert sum(q for q, _ in seqs) <= 96
    case = cases.make_case(
        11,
        seqs,
        num_slots=20,
        page_size=4,
        pages_per_seq=24,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=64,
        num_tokens=96,
    )
    check(case, dict(sm_scale=0.125), jnp.float32, pages_per_block=2)
    check(case, dict(sm_scale=0.2, sliding_window=9, soft_cap=5.0), jnp.float32, pages_per_block=1)
    # KV blocks of one page: the tiles' online softmax runs over many blocks.
    check(case, dict(sm_scale=0.125), jnp.float32, pages_per_block=2, tile_kv_pages=1)
    check(case, dict(sm_scale=0.2, sliding_window=9), jnp.float32, pages_per_block=3, tile_kv_pages=3)
    # Wide blocks, then two-page ones for the rest of each row's and tile's keys, under a window.
    check(
        case,
        dict(sm_scale=0.2, sliding_window=9),
        jnp.float32,
        pages_per_block=4,
        tile_kv_pages=6,
        tail_kv_pages=2,
    )


@pytest.mark.timeout(240)
def test_blocked_long_step_fp8_scales():
    seqs = LONG_STEPS["decodes_then_prefills"]
    case = cases.make_case(
        12,
        seqs,
        num_slots=20,
        page_size=4,
        pages_per_seq=24,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=64,
        num_tokens=64,
        kv_dtype=jnp.float8_e4m3fn,
    )
    check(case, dict(sm_scale=0.125, k_scale=0.5, v_scale=1.5), jnp.float32, pages_per_block=None)


# Sequences whose page tables start with the same pages (a cached system prompt): the shared pages
# that lie wholly before every sequence's first query are attended once for all rows (cascade) and
# merged with each sequence's own rest. (seqs, pages the live rows share, the prefix that must be
# found): decodes; chunks and a decode; the prefix cut where a chunk's queries start inside the
# shared pages (its new tokens land in pages the other sequence reads); decodes after padding slots.
SHARED_PREFIX = {
    "decodes": ([(1, 70)] * 4, 16, 16),
    "chunks_and_decode": ([(20, 60), (9, 50), (1, 45), (33, 80)], 10, 10),
    "cut_at_first_query": ([(12, 30), (1, 41)], 8, 4),
    "one_sequence_chunk": ([(40, 90)], 0, 12),  # its own earlier pages are a prefix too
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(SHARED_PREFIX))
def test_blocked_shared_prefix_cascade(name):
    seqs, shared, want_prefix = SHARED_PREFIX[name]
    case = cases.make_case(
        13,
        seqs,
        num_slots=6,
        page_size=4,
        pages_per_seq=24,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=64,
        num_tokens=96,
    )
    table = np.asarray(case.page_indices).copy()
    table[1 : len(seqs), :shared] = table[0, :shared]
    case = dataclasses.replace(case, page_indices=jnp.asarray(table))
    found = common_prefix_pages(*case.metadata, page_size=4)
    assert int(found) == want_prefix  # the cascade path really runs (and stops where it must)
    check(case, dict(sm_scale=0.125), jnp.float32, pages_per_block=2)
    check(case, dict(sm_scale=0.2, soft_cap=5.0), jnp.float32, pages_per_block=3, tile_kv_pages=1)
    check(case, dict(sm_scale=0.2, sliding_window=9), jnp.float32, pages_per_block=1)
    # What follows the prefix in wide blocks and then one-page ones.
    check(case, dict(sm_scale=0.125), jnp.float32, pages_per_block=4, tile_kv_pages=4, tail_kv_pages=1)


def test_common_prefix_pages_needs_every_live_row():
    """A padding slot's row does not count; one live row that differs ends the prefix."""
    table = jnp.asarray([[5, 6, 7, 8], [5, 6, 9, 9], [0, 0, 0, 0]], jnp.int32)
    kv_lens = jnp.asarray([16, 16, 0], jnp.int32)
    cu = jnp.asarray([0, 1, 2, 2], jnp.int32)
    assert int(common_prefix_pages(kv_lens, table, cu, jnp.asarray([2], jnp.int32), 4)) == 2
    assert int(common_prefix_pages(kv_lens, table, cu, jnp.asarray([1], jnp.int32), 4)) == 3
    assert int(common_prefix_pages(kv_lens, table, cu, jnp.asarray([0], jnp.int32), 4)) == 0

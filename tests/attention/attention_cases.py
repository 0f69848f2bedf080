"""Shared random ragged attention steps and their expected results, for every attention test file.

``CASES`` / ``build`` give the batches; ``expected`` runs the jnp reference (attention/reference.py);
``oracle`` runs jax's own ``ref_ragged_paged_attention`` (an independent oracle: a per-sequence
Python loop). A uniquely named module rather than a test file, so test modules import it directly
(pytest puts this directory on sys.path).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from tpuserve.attention.reference import ragged_paged_attention_ref, write_kv_ref


@dataclasses.dataclass
class Case:
    """One random ragged step. Shapes as in attention/reference.py."""

    queries: jax.Array  # [T, Hq, D]
    new_kv: jax.Array  # [T, 2*Hkv, D]
    kv_pages: jax.Array  # [P, page_size, 2*Hkv, D] before this step's write
    kv_lens: jax.Array  # [S]
    page_indices: jax.Array  # [S, pages_per_seq]
    cu_q_lens: jax.Array  # [S + 1]
    num_seqs: jax.Array  # [1]

    @property
    def metadata(self):
        return self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_q_lens[int(self.num_seqs[0])])


def make_case(
    seed: int,
    seqs,
    *,
    num_slots: int,
    page_size: int,
    pages_per_seq: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
    dtype=jnp.float32,
    kv_dtype=None,
) -> Case:
    """seqs: [(q_len, kv_len)] of the live sequences; slots past len(seqs) are padding.

    Pages are a random permutation of 1..P-1 (page 0 stays reserved, padding entries point at it);
    the cache is filled with random values so stale rows are never accidentally zero.
    """
    rng = np.random.default_rng(seed)
    q_lens = [q for q, _ in seqs]
    total = sum(q_lens)
    assert total <= num_tokens and len(seqs) <= num_slots
    assert all(q <= kv <= page_size * pages_per_seq for q, kv in seqs)
    num_pages = 1 + num_slots * pages_per_seq
    perm = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((num_slots, pages_per_seq), np.int32)
    used = 0
    for s, (_, kv_len) in enumerate(seqs):
        n = -(-kv_len // page_size)
        page_indices[s, :n] = perm[used : used + n]
        used += n
    cu = np.full(num_slots + 1, total, np.int32)
    cu[0] = 0
    cu[1 : len(seqs) + 1] = np.cumsum(q_lens)
    kv_lens = np.zeros(num_slots, np.int32)
    kv_lens[: len(seqs)] = [kv for _, kv in seqs]
    shape_kv = (num_pages, page_size, 2 * num_kv_heads, head_dim)
    return Case(
        queries=jnp.asarray(rng.standard_normal((num_tokens, num_q_heads, head_dim)), dtype),
        new_kv=jnp.asarray(rng.standard_normal((num_tokens, 2 * num_kv_heads, head_dim)), kv_dtype or dtype),
        kv_pages=jnp.asarray(rng.standard_normal(shape_kv), kv_dtype or dtype),
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(page_indices),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("kwargs",))
def _expected(queries, new_kv, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kwargs):
    kv = write_kv_ref(kv_pages, new_kv, kv_lens, page_indices, cu_q_lens, num_seqs)
    out = ragged_paged_attention_ref(queries, kv, kv_lens, page_indices, cu_q_lens, num_seqs, **dict(kwargs))
    return out, kv


def expected(case: Case, **kwargs):
    """(out [T, Hq, D], written kv_pages) from the jnp reference (jitted: eager costs seconds)."""
    return _expected(case.queries, case.new_kv, case.kv_pages, *case.metadata, tuple(sorted(kwargs.items())))


def oracle(case: Case, kv_pages, **kwargs):
    """jax's ref_ragged_paged_attention on the written cache: [num_real_tokens, Hq, D].

    It loops over sequences in Python, so it cannot take traced metadata; run eagerly it compiles
    every op once per shape (seconds per case). Tracing it under jit with the metadata as numpy
    constants runs the very same code as one compiled program.
    """
    metadata = tuple(np.asarray(x) for x in case.metadata)
    run = jax.jit(lambda q, kv: ref_ragged_paged_attention(q, kv, *metadata, **kwargs))
    return run(case.queries, kv_pages)


def check_step(case: Case, kwargs: dict, dtype, out, kv_pages):
    """A kernel's step against both oracles: ``kv_pages`` (the written cache, in the interleaved
    layout) == the reference's exactly, ``out`` == the reference's and == jax's oracle's on the real
    tokens, within ``dtype``'s tolerance."""
    want, want_kv = expected(case, **kwargs)
    np.testing.assert_array_equal(f32(kv_pages), f32(want_kv))
    np.testing.assert_allclose(f32(out), f32(want), **tolerance(dtype))
    n = case.num_real_tokens
    np.testing.assert_allclose(f32(out[:n]), f32(oracle(case, want_kv, **kwargs)), **tolerance(dtype))


def f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def tolerance(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == jnp.float32 else dict(atol=4e-2, rtol=4e-2)


# ---- the shared cases: every kernel test file runs these same batches ----

MIXED = [(1, 9), (5, 11), (4, 4), (1, 1), (2, 21)]  # chunk 6..10 crosses a page; 1 page; 1 token
CASES = {
    # name: (make_case arguments, attention kwargs)
    "decode_g8": (
        dict(
            seqs=[(1, 1), (1, 8), (1, 13), (1, 24)], num_q_heads=8, num_kv_heads=1, head_dim=64, num_tokens=6
        ),
        dict(sm_scale=0.125),
    ),
    "prefill_g1": (
        dict(seqs=[(7, 7), (4, 4), (12, 12)], num_q_heads=2, num_kv_heads=2, head_dim=64, num_tokens=24),
        dict(sm_scale=0.125),
    ),
    "mixed_g3_d128": (
        dict(seqs=MIXED, num_q_heads=6, num_kv_heads=2, head_dim=128, num_tokens=16),
        dict(sm_scale=0.09),
    ),
    "window_g8": (
        dict(
            seqs=[(1, 21), (6, 17), (2, 2), (1, 5)], num_q_heads=8, num_kv_heads=1, head_dim=64, num_tokens=12
        ),
        dict(sm_scale=0.3, sliding_window=5),
    ),
    "soft_cap_g1": (
        dict(seqs=MIXED, num_q_heads=2, num_kv_heads=2, head_dim=64, num_tokens=16),
        dict(sm_scale=0.5, soft_cap=2.0),
    ),
    "bf16_g3_d128": (
        dict(seqs=MIXED, num_q_heads=6, num_kv_heads=2, head_dim=128, num_tokens=16, dtype=jnp.bfloat16),
        dict(sm_scale=0.09),
    ),
    "fp8_scales_g3": (
        dict(
            seqs=MIXED, num_q_heads=6, num_kv_heads=2, head_dim=64, num_tokens=16, kv_dtype=jnp.float8_e4m3fn
        ),
        dict(sm_scale=0.125, k_scale=0.5, v_scale=1.5),
    ),
}
SHAPES = dict(num_slots=6, page_size=4, pages_per_seq=6)


def build(name: str, seed: int = 0):
    """(Case, attention kwargs, output dtype) of a shared case."""
    case_args, kwargs = CASES[name]
    case = make_case(seed, **case_args, **SHAPES)
    return case, kwargs, case.queries.dtype

"""The jnp reference (attention/reference.py) against jax's own ``ref_ragged_paged_attention``.

jax's function is an independent oracle (a per-sequence Python loop, eager only); the shared cases
live in attention_cases.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import CASES, MIXED, build, expected, f32, oracle, tolerance

from tpuserve.attention.reference import ragged_paged_attention_ref, write_kv_ref

# ---- reference vs oracle ----


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_jax_oracle(name):
    case, kwargs, dtype = build(name)
    out, kv = expected(case, **kwargs)
    want = oracle(case, kv, **kwargs)
    n = case.num_real_tokens
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else tolerance(dtype)
    np.testing.assert_allclose(f32(out[:n]), f32(want), **tol)
    assert not np.any(f32(out[n:]))  # padding tokens are zeros


@pytest.mark.timeout(120)
def test_reference_window_and_cap_together():
    case, _, _ = build("window_g8", seed=1)
    kwargs = dict(sm_scale=0.3, sliding_window=3, soft_cap=4.0)
    out, kv = expected(case, **kwargs)
    np.testing.assert_allclose(
        f32(out[: case.num_real_tokens]), f32(oracle(case, kv, **kwargs)), atol=1e-5, rtol=1e-5
    )


@pytest.mark.timeout(60)
def test_write_kv_ref_places_rows():
    """Each real token lands at page_indices[s, pos // ps], row pos % ps; nothing else changes."""
    case, _, _ = build("mixed_g3_d128")
    got = f32(write_kv_ref(case.kv_pages, case.new_kv, *case.metadata))
    want = f32(case.kv_pages).copy()
    pages, new = np.asarray(case.page_indices), f32(case.new_kv)
    t = 0
    for s, (q_len, kv_len) in enumerate(MIXED):
        for pos in range(kv_len - q_len, kv_len):
            want[pages[s, pos // 4], pos % 4] = new[t]
            t += 1
    np.testing.assert_array_equal(got, want)


@pytest.mark.timeout(60)
def test_reference_eager_equals_jit():
    case, kwargs, _ = build("soft_cap_g1")
    jitted, kv = expected(case, **kwargs)
    eager = ragged_paged_attention_ref(case.queries, kv, *case.metadata, **kwargs)
    np.testing.assert_allclose(f32(eager), f32(jitted), atol=1e-6, rtol=1e-6)

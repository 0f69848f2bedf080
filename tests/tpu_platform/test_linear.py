"""linear(): dense arrays, a registered weight record type, and a clear error for anything else;
the routing table is the active one only (each runner has its own)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.tpu_platform.linear import LinearImpls, linear


def _rand(*shape, seed=0):
    return np.random.RandomState(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("as_jax", [False, True])
def test_dense_matches_matmul_and_keeps_output_axes(as_jax):
    x, w, b = _rand(5, 8), _rand(8, 3, 4, seed=1), _rand(3, 4, seed=2)
    wj = jnp.asarray(w) if as_jax else w
    y = jax.jit(linear)(jnp.asarray(x), wj, jnp.asarray(b))  # tracers take the dense path too
    assert y.shape == (5, 3, 4) and y.dtype == jnp.float32
    ref = (x.astype(np.float64) @ w.reshape(8, 12).astype(np.float64)).reshape(5, 3, 4) + b
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
    # Same numbers as the plain 2-D matmul the decoder did before weights had several output axes.
    flat = np.asarray(jnp.asarray(x) @ w.reshape(8, 12)).reshape(5, 3, 4)
    np.testing.assert_array_equal(np.asarray(linear(jnp.asarray(x), wj)), flat)


def test_dense_out_dtype_f32_from_bf16():
    x, w = jnp.asarray(_rand(4, 16), jnp.bfloat16), jnp.asarray(_rand(16, 6, seed=1), jnp.bfloat16)
    assert linear(x, w).dtype == jnp.bfloat16  # activation dtype by default
    y = linear(x, w, out_dtype=jnp.float32)  # the LM head's f32 logits
    assert y.dtype == jnp.float32
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)


@jax.tree_util.register_dataclass
@dataclass
class _Int8Weight:
    """A toy quantized record: int8 values [in, out] and one f32 scale per output column."""

    q: jax.Array
    scale: jax.Array


def _int8_linear(x, w: _Int8Weight, bias, out_dtype):
    y = jnp.dot(x, w.q.astype(x.dtype)) * w.scale.astype(x.dtype)
    if bias is not None:
        y = y + bias
    return y.astype(out_dtype or x.dtype)


def _int8_record(w):
    scale = np.abs(w).max(axis=0) / 127
    return _Int8Weight(q=jnp.asarray(np.round(w / scale), jnp.int8), scale=jnp.asarray(scale))


def test_registered_record_type_dispatches_under_jit():
    w = _rand(8, 6, seed=3)
    rec = _int8_record(w)
    x, b = jnp.asarray(_rand(3, 8)), jnp.asarray(_rand(6, seed=4))
    with LinearImpls().register(_Int8Weight, _int8_linear).active():
        y = jax.jit(linear)(x, rec, b)
        assert linear(x, rec, out_dtype=jnp.float32).dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ w + np.asarray(b), atol=0.05)


def test_a_table_routes_only_while_active_and_tables_do_not_share_types():
    rec = _int8_record(_rand(8, 6, seed=3))
    x = jnp.asarray(_rand(3, 8))
    mine, other = LinearImpls().register(_Int8Weight, _int8_linear), LinearImpls()
    with pytest.raises(TypeError, match="needs an active LinearImpls"):
        linear(x, rec)
    with mine.active():
        linear(x, rec)
        with other.active(), pytest.raises(TypeError, match="registered types: none"):
            linear(x, rec)  # the inner table is the one in force, and it never saw _Int8Weight
        linear(x, rec)  # back to the outer table
    with pytest.raises(TypeError, match="needs an active LinearImpls"):
        linear(x, rec)


def test_unknown_weight_type_is_a_clear_type_error():
    class Mystery:
        pass

    with (
        LinearImpls().active(),
        pytest.raises(TypeError, match="no implementation for weight of type .*Mystery.*register"),
    ):
        linear(jnp.ones((2, 3)), Mystery())
    with pytest.raises(TypeError, match="wants a type"):
        LinearImpls().register("fp8", _int8_linear)

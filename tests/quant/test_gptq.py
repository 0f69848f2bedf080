"""GPTQ for MXFP4 / NVFP4 (quant/gptq.py) and the layer-by-layer calibration
(tpu_platform/models/calibrate.py).

* With uncorrelated inputs (H = I) GPTQ has nothing to propagate: its records must equal the
  data-free per-block search's (quant/search.py) bit for bit, an independent code path.
* With correlated inputs its output error ``|X (W - deq(Q))|`` must beat that search's, measured
  through the records' reference dequant (so the codes and scales it reports are the ones stored).
* On a tiny decoder, the calibrated layers must keep the model's hidden states closer to the
  dense model's than round-to-nearest does, and the stacked and unrolled trees must agree.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.quant import fp4
from tpuserve.quant import gptq as gptq_module
from tpuserve.quant.gptq import damped_cholesky_inverse, e2m1_round
from tpuserve.quant.search import quantize_mxfp4_search, quantize_nvfp4_search
from tpuserve.tpu_platform.models.calibrate import gptq_record

SEARCH = {"mxfp4": quantize_mxfp4_search, "nvfp4": quantize_nvfp4_search}
DEQUANT = {"mxfp4": fp4.dequantize_mxfp4, "nvfp4": fp4.dequantize_nvfp4}


def _weights(k, n, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    w[rng.random((k, n)) < 0.01] *= 8  # a few outliers, as real weights have
    return w


def test_e2m1_round_is_nearest_and_saturates():
    step = np.ones(9)
    x = np.array([0.2, 0.3, -0.7, 1.3, 2.6, 3.4, 5.1, 9.0, -100.0])
    codes, deq = e2m1_round(x, step)
    np.testing.assert_array_equal(deq, [0, 0.5, -0.5, 1.5, 3, 3, 6, 6, -6])
    np.testing.assert_array_equal(np.asarray(fp4.e2m1_lut_decode(jnp.asarray(codes))), deq)
    # A block of rows (past _SEARCH_MAX elements: counted by comparisons, not searched) rounds
    # alike, ties at the decision points (down) and NaN (to the top code) included.
    mids = gptq_module._E2M1_MID
    row = np.concatenate([x, mids, -mids, np.nextafter(mids, 9), [0.0, -0.0, np.inf, np.nan]])
    block = np.tile(row, (gptq_module._SEARCH_MAX // len(row) + 1, 1))
    got_codes, got_deq = e2m1_round(block, 1.0)
    want_codes, want_deq = e2m1_round(row, 1.0)
    assert block.size > gptq_module._SEARCH_MAX and got_codes.dtype == np.uint8
    np.testing.assert_array_equal(got_codes, np.broadcast_to(want_codes, block.shape))
    np.testing.assert_array_equal(got_deq, np.broadcast_to(want_deq, block.shape))


def test_dead_inputs_are_tolerated():
    h = np.diag([4.0, 0.0, 1.0])
    u, dead = damped_cholesky_inverse(h, 0.01)
    assert dead.tolist() == [False, True, False] and np.all(np.isfinite(u))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_identity_hessian_reduces_to_the_block_search(fmt):
    w = _weights(128, 48)
    got = gptq_record(w, np.eye(128), fmt)
    want = SEARCH[fmt](w)
    np.testing.assert_array_equal(np.asarray(got.packed), np.asarray(want.packed))
    np.testing.assert_array_equal(np.asarray(got.scale).view(np.uint8), np.asarray(want.scale).view(np.uint8))
    if fmt == "nvfp4":
        np.testing.assert_array_equal(np.asarray(got.global_scale), np.asarray(want.global_scale))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_correlated_inputs_lower_the_output_error(fmt):
    k, n, t = 256, 64, 2048
    rng = np.random.default_rng(1)
    mix = np.eye(k) + rng.standard_normal((k, k)) / np.sqrt(k)
    x = (rng.standard_normal((t, k)) * rng.uniform(0.2, 3.0, k)) @ mix  # uneven, correlated channels
    w = _weights(k, n, seed=2)
    rec = gptq_record(w, x.T @ x, fmt)
    assert rec.packed.shape == (k // 2, n) and rec.scale.shape == (k // fp4_block(fmt), n)
    err_gptq = np.linalg.norm(x @ (np.asarray(DEQUANT[fmt](rec)) - w))
    err_rtn = np.linalg.norm(x @ (np.asarray(DEQUANT[fmt](SEARCH[fmt](w))) - w))
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def fp4_block(fmt):
    return fp4.MXFP4_BLOCK if fmt == "mxfp4" else fp4.NVFP4_BLOCK


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_calibrated_layers_track_the_dense_model_better_than_rtn(fmt):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tpu_platform"))
    import tiny_models  # tests/tpu_platform/tiny_models.py

    from tpuserve.tpu_platform.linear import quant_linear_impls
    from tpuserve.tpu_platform.models import decoder
    from tpuserve.tpu_platform.models.calibrate import quantize_layers_gptq
    from tpuserve.tpu_platform.models.quantize import quantize_params
    from tpuserve.tpu_platform.models.weights import unstack_layers

    impls = quant_linear_impls()
    arch, _, params = tiny_models.tiny_model("llama", hidden=64, ffn=128, layers=2)
    rng = np.random.default_rng(3)
    calib = rng.integers(0, arch.vocab_size, 700).astype(np.int32)
    held_out = tiny_models.ragged_step(arch, [30, 20], seed=7)

    def hidden(p):
        with impls.active():
            return hidden_of(p)

    def hidden_of(p):
        return np.asarray(
            decoder.forward(
                p,
                tiny_models.empty_kv_cache(arch),
                held_out["token_ids"],
                held_out["positions"],
                held_out["md"],
                arch=arch,
                attn_impl="reference",
                inv_freq=jnp.asarray(arch.inv_freq()),
            ).hidden
        )

    want = hidden(params)
    gptq = quantize_layers_gptq(params, arch, calib, fmt)
    rtn, _ = quantize_params(params, fmt)
    assert isinstance(gptq["layers"]["down"], type(rtn["layers"]["down"]))
    err_gptq = np.linalg.norm(hidden(gptq) - want)
    err_rtn = np.linalg.norm(hidden(rtn) - want)
    assert 0 < err_gptq < err_rtn, (err_gptq, err_rtn)
    # the unrolled tree gets the same records
    unrolled = quantize_layers_gptq(unstack_layers(params), arch, calib, fmt)
    for a, b in zip(
        jax.tree_util.tree_leaves(unrolled["layers"][1]["qkv"]),
        jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x: x[1], gptq["layers"]["qkv"])),
    ):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_hadamard_blocks_is_orthonormal_and_its_own_inverse():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 96)), jnp.float32)
    y = fp4.hadamard_blocks(x)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(fp4.hadamard_blocks(y), x, atol=1e-5)
    # along the weight axis it is the same matrix: (x R) @ (R W) == x @ W
    w = jnp.asarray(np.random.default_rng(5).standard_normal((96, 8)), jnp.float32)
    np.testing.assert_allclose(y @ fp4.hadamard_blocks(w, axis=-2), x @ w, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of 32"):
        fp4.hadamard_blocks(jnp.zeros((2, 48)))


def test_rotated_mxfp4_record_multiplies_like_its_dequant():
    from tpuserve.quant.dispatch import quant_linear

    k, n, t = 128, 40, 512
    rng = np.random.default_rng(6)
    x = rng.standard_normal((t, k)) * rng.uniform(0.2, 3.0, k)
    w = _weights(k, n, seed=7)
    rec = gptq_record(w, x.T @ x, "mxfp4", rotate=True)
    assert rec.rotated
    deq = np.asarray(fp4.dequantize_mxfp4(rec))  # in the original basis
    xs = jnp.asarray(x[:16], jnp.float32)
    np.testing.assert_allclose(np.asarray(quant_linear(xs, rec)), np.asarray(xs) @ deq, rtol=1e-4, atol=1e-4)
    # and it approximates w at least as well, on these inputs, as the unrotated GPTQ record
    plain = np.asarray(fp4.dequantize_mxfp4(gptq_record(w, x.T @ x, "mxfp4")))
    assert np.linalg.norm(x @ (deq - w)) < np.linalg.norm(x @ (plain - w)) * 1.1


def test_singular_hessian_still_factors():
    # fewer tokens than inputs: X^T X is singular, and only the damping makes it definite
    x = np.random.default_rng(8).standard_normal((10, 64)) * 1e3
    u, dead = damped_cholesky_inverse(x.T @ x, 1e-12)
    assert np.all(np.isfinite(u)) and not dead.any()
    np.testing.assert_allclose(u, np.triu(u))


def test_float64_rotation_matches_the_runtime_one():
    from tpuserve.tpu_platform.models.calibrate import _rotate_rows

    a = np.random.default_rng(9).standard_normal((96, 5))
    np.testing.assert_allclose(
        _rotate_rows(a), np.asarray(fp4.hadamard_blocks(jnp.asarray(a, jnp.float32), axis=-2)), atol=1e-5
    )


@pytest.mark.parametrize("fmt, act_order", [("mxfp4", True), ("nvfp4", False)])
def test_a_block_of_columns_gets_the_whole_weights_codes(fmt, act_order):
    """What quantizing by device shard rests on: GPTQ rounds every column on its own given H, so
    a block of columns (with the whole weight's largest magnitude, NVFP4's global scale) gets
    exactly the codes and scales the whole weight's GPTQ gives those columns."""
    from tpuserve.quant.gptq import gptq_fp4

    w = _weights(128, 96)
    x = np.random.default_rng(1).standard_normal((400, 128)) @ np.random.default_rng(2).standard_normal(
        (128, 128)
    )
    h = x.T @ x
    codes, scales, g = gptq_fp4(w, h, fmt, act_order=act_order)
    amax = float(np.max(np.abs(w)))
    for lo in range(0, 96, 24):
        c, s, gb = gptq_fp4(w[:, lo : lo + 24], h, fmt, act_order=act_order, amax=amax)
        assert np.array_equal(c, codes[:, lo : lo + 24])
        assert np.array_equal(
            np.asarray(s).view(np.uint8), np.asarray(scales)[:, lo : lo + 24].view(np.uint8)
        )
        assert gb == g
    if fmt == "nvfp4":  # without the whole weight's amax a block picks its own global scale
        lo = 0 if np.argmax(np.max(np.abs(w), axis=0)) >= 24 else 24  # a block without the max
        assert gptq_fp4(w[:, lo : lo + 24], h, fmt)[2] != g


# A weight placed over 4 fake devices, split by rows or by columns as the runner splits
# row- and column-parallel weights: gptq_record quantizes it by device column blocks.
_BY_DEVICE = """
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P
from tpuserve.tpu_platform.mesh import build_mesh
from tpuserve.tpu_platform.models.calibrate import gptq_record
rng = np.random.default_rng(0)
w = (rng.standard_normal((128, 2, 48)) * 0.05).astype(np.float32)
x = rng.standard_normal((300, 128)) @ rng.standard_normal((128, 128))
h = x.T @ x
mesh = build_mesh(4)
for fmt, rotate in (("mxfp4", True), ("mxfp4", False), ("nvfp4", False)):
    whole = gptq_record(w, h, fmt, rotate=rotate)
    for spec in (P("model", None, None), P(None, None, "model")):
        rec = gptq_record(jax.device_put(w, NamedSharding(mesh, spec)), h, fmt, rotate=rotate)
        assert rec.packed.sharding.mesh.shape["model"] == 4, rec.packed.sharding
        for a, b in zip(jax.tree_util.tree_leaves(rec), jax.tree_util.tree_leaves(whole)):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), (fmt, spec)
        assert rec.out_shape == whole.out_shape == (2, 48), (rec.out_shape, whole.out_shape)
print("OK")
"""


def test_a_weight_on_a_mesh_is_quantized_by_device_columns_like_the_whole(tmp_path):
    script = tmp_path / "by_device.py"
    script.write_text(_BY_DEVICE)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tpu_platform"))
    try:
        from fake_devices import run_with_devices  # tests/tpu_platform/fake_devices.py
    finally:
        sys.path.pop(0)
    assert run_with_devices(str(script), devices=4, timeout=300).strip().endswith("OK")

"""``linear(x, record)`` for quantized records: the XLA path CPU runs, and its routing.

The expected value is ``x @ dequant(record)`` in f32 at HIGHEST precision, where the dequant is
the one held bit-exact against torchao / compressed-tensors / transformers / gguf in
test_quant_formats.py; the per-token activation quant is held bit-exact against
compressed-tensors' dynamic token quantization. A last check compares against the dense weight
the record was made from (the quantization error must be that of the format, no more).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tpuserve.quant import fp4, fp8
from tpuserve.quant.dispatch import quant_linear
from tpuserve.tpu_platform.linear import linear, quant_linear_impls

K, OUT = 256, (3, 5, 16)  # multi-axis output like qkv's [Hkv, G+2, D]; N = 240
N = int(np.prod(OUT))

QUANTIZERS = {
    "fp8_tensor": lambda w: fp8.quantize_fp8(w, "tensor"),
    "fp8_channel": lambda w: fp8.quantize_fp8(w, "channel"),
    "fp8_block": lambda w: fp8.quantize_fp8(w, "block", block_size=128),
    "fp8_block_w8a8": lambda w: fp8.quantize_fp8(w, "block", block_size=128, act_quant=True),
    "fp8_channel_w8a8": lambda w: fp8.quantize_fp8(w, "channel", act_quant=True),
    "mxfp4": fp4.quantize_mxfp4,
    "nvfp4": fp4.quantize_nvfp4,
}
# relative error of x @ W_q against x @ W: what the format allows, with margin
DENSE_TOL = {"fp8": 0.04, "mxfp4": 0.2, "nvfp4": 0.15}


@pytest.fixture(autouse=True)
def _routing():
    """Each test runs under the default quantized routing (what a runner activates)."""
    with quant_linear_impls().active():
        yield


def dense_weight(seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.standard_normal((K, *OUT)) / np.sqrt(K)).astype(np.float32))


def activations(seed=1, shape=(2, 3)):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((*shape, K)).astype(np.float32))


def expected(x, rec, bias=None):
    deq = (
        fp8.dequantize_fp8(rec)
        if isinstance(rec, fp8.Fp8Weight)
        else fp4.dequantize_mxfp4(rec)
        if isinstance(rec, fp4.Mxfp4Weight)
        else fp4.dequantize_nvfp4(rec)
    )
    xf = x.reshape(-1, K)
    if getattr(rec, "act_quant", False):
        xq, sx = fp8.quantize_per_token(xf)
        xf = xq.astype(jnp.float32) * sx
    y = jnp.dot(xf, deq.reshape(K, N), precision=lax.Precision.HIGHEST)
    y = y.reshape(*x.shape[:-1], *OUT)
    return y if bias is None else y + bias


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", list(QUANTIZERS))
def test_linear_matches_dequant_reference(fmt):
    rec = QUANTIZERS[fmt](dense_weight())
    x = activations()
    bias = jnp.asarray(np.random.default_rng(2).standard_normal(OUT).astype(np.float32))
    y = jax.jit(lambda x, r, b: linear(x, r, b))(x, rec, bias)
    assert y.shape == (2, 3, *OUT) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected(x, rec, bias)), rtol=2e-5, atol=2e-5)
    # and the quantization error is the format's, measured against the dense weight
    dense = jnp.tensordot(x, dense_weight(), axes=1, precision=lax.Precision.HIGHEST) + bias
    rel = float(jnp.linalg.norm(y - dense) / jnp.linalg.norm(dense))
    assert rel < DENSE_TOL[fmt.split("_")[0]], rel


@pytest.mark.timeout(120)
def test_linear_out_dtype_and_bf16_activations():
    rec = fp4.quantize_nvfp4(dense_weight())
    x = activations().astype(jnp.bfloat16)
    y = linear(x, rec)
    assert y.dtype == jnp.bfloat16
    y32 = linear(x, rec, out_dtype=jnp.float32)
    assert y32.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(y32), np.asarray(expected(x.astype(jnp.float32), rec)), rtol=2e-2, atol=2e-2
    )


@pytest.mark.timeout(120)
def test_per_token_activation_quant_matches_compressed_tensors():
    pytest.importorskip("compressed_tensors")
    import ct_oracle as ct
    import torch
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((1, 12, K)) * np.exp(rng.uniform(-6, 6, (1, 12, 1)))).astype(np.float32)
    x[0, 3] = 0.0
    args = ct.scheme("FP8_DYNAMIC").input_activations
    scale, zp = compute_dynamic_scales_and_zp(torch.from_numpy(x), args, module=None)
    want = quantize(torch.from_numpy(x), scale, zp, args, dtype=torch.float8_e4m3fn)
    xq, sx = fp8.quantize_per_token(jnp.asarray(x[0]))
    assert np.array_equal(np.asarray(sx).view(np.uint32), scale.numpy()[0].view(np.uint32))
    assert np.array_equal(np.asarray(xq).view(np.uint8), want.view(torch.uint8).numpy()[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4"])
def test_stacked_records_run_under_scan_like_the_decoder(fmt):
    rng = np.random.default_rng(5)
    ws = jnp.asarray((rng.standard_normal((3, K, *OUT)) / 16).astype(np.float32))
    q = {
        "fp8_block": lambda w: fp8.quantize_fp8(w, "block", block_size=128, num_lead=1),
        "mxfp4": lambda w: fp4.quantize_mxfp4(w, num_lead=1),
        "nvfp4": lambda w: fp4.quantize_nvfp4(w, num_lead=1),
    }[fmt]
    stacked = q(ws)
    x = activations(shape=(4,))

    def body(h, rec):
        y = linear(h, rec)
        return h, y

    _, ys = jax.jit(lambda r: lax.scan(body, x, r))(stacked)
    for i in range(3):
        layer = jax.tree_util.tree_map(lambda a: a[i], stacked)
        np.testing.assert_allclose(np.asarray(ys[i]), np.asarray(expected(x, layer)), rtol=2e-5, atol=2e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["fp8_block_w8a8", "nvfp4"])
def test_pallas_route_through_linear_in_interpret_mode(fmt):
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
    impls = quant_linear_impls("pallas_tpu", interpret=pltpu.InterpretParams(detect_races=True))
    rec = QUANTIZERS[fmt](dense_weight())
    x = activations(shape=(5,))
    with impls.active():
        got = linear(x, rec)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected(x, rec)), rtol=2e-5, atol=2e-5)
    pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.timeout(60)
def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl"):
        quant_linear_impls("cuda")
    assert quant_linear is not None

"""``quantize_params``: the decoder's tree in, records out, weight bytes before/after reported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.quant import fp4, fp8
from tpuserve.tpu_platform.linear import linear, quant_linear_impls
from tpuserve.tpu_platform.models.quantize import METHODS, quantize_params

L, H, HKV, G, D, F, V = 2, 128, 2, 2, 32, 256, 64


@pytest.fixture(autouse=True)
def _routing():
    with quant_linear_impls().active():  # what a runner activates over quantized weights
        yield


def tree(dtype=jnp.float32):
    """A small tree shaped like build_params' output (random values)."""
    rng = np.random.default_rng(0)

    def a(*shape):
        return jnp.asarray(
            (rng.standard_normal(shape) / np.sqrt(shape[1] if len(shape) > 1 else 1)).astype(np.float32),
            dtype,
        )

    return {
        "embed": a(V, H),
        "final_norm": a(H),
        "lm_head": a(H, V),
        "layers": {
            "qkv": a(L, H, HKV, G + 2, D),
            "o": a(L, HKV * G * D, H),
            "gate_up": a(L, 2, H, F),  # the decoder tree's [2, H, F]
            "down": a(L, F, H),
            "input_norm": a(L, H),
            "post_norm": a(L, H),
        },
    }


REC = {
    "fp8": fp8.Fp8Weight,
    "fp8_w8a8": fp8.Fp8Weight,
    "fp8_block": fp8.Fp8Weight,
    "mxfp4": fp4.Mxfp4Weight,
    "nvfp4": fp4.Nvfp4Weight,
}
MAX_RATIO = {"fp8": 0.52, "fp8_w8a8": 0.52, "fp8_block": 0.52, "mxfp4": 0.30, "nvfp4": 0.30}
REL_ERR = {"fp8": 0.04, "fp8_w8a8": 0.06, "fp8_block": 0.04, "mxfp4": 0.2, "nvfp4": 0.15}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
def test_quantize_params_stacked(method):
    params = tree(jnp.bfloat16)
    q, report = quantize_params(params, method, lm_head=True)
    for key in ("qkv", "o", "gate_up", "down"):
        assert isinstance(q["layers"][key], REC[method])
    assert isinstance(q["lm_head"], REC[method])
    assert q["layers"]["input_norm"] is params["layers"]["input_norm"] and q["embed"] is params["embed"]
    assert report.dense_bytes == report.bf16_bytes  # the tree was bf16
    assert report.ratio_vs_bf16 <= MAX_RATIO[method], report.summary()
    assert report.total_after < report.total_before
    # one layer of one matmul through linear (the quantized routing) vs the dense weight
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, H)).astype(np.float32))
    layer = jax.tree_util.tree_map(lambda a: a[1], q["layers"]["gate_up"])
    want = jnp.tensordot(x, params["layers"]["gate_up"][1].swapaxes(0, 1).astype(jnp.float32), axes=1)
    got = linear(x, layer)
    assert got.shape == (3, 2, F)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < REL_ERR[method]


@pytest.mark.timeout(120)
def test_quantize_params_unrolled_layers_and_report():
    params = tree()
    unrolled = {
        **params,
        "layers": [jax.tree_util.tree_map(lambda a: a[i], params["layers"]) for i in range(L)],
    }
    q, report = quantize_params(unrolled, "nvfp4")
    assert all(isinstance(layer["down"], fp4.Nvfp4Weight) for layer in q["layers"])
    assert q["layers"][0]["down"].packed.shape == (F // 2, H)
    assert "lm_head" in q and not isinstance(q["lm_head"], fp4.Nvfp4Weight)  # not asked for
    n = sum(int(np.prod(params["layers"][k].shape)) for k in ("qkv", "o", "gate_up", "down"))
    assert report.dense_bytes == 4 * n and report.bf16_bytes == 2 * n
    # 0.5 byte per element, one e4m3 scale per 16, one f32 global per matrix
    assert report.quant_bytes == n // 2 + n // 16 + 4 * 4 * L
    assert "nvfp4" in report.summary()


@pytest.mark.timeout(60)
def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method"):
        quantize_params(tree(), "int3")

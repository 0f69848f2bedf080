"""``quant/fuse.py`` (records fused along the output axis) and ``quant/search.py`` (FP4 scale search).

Fusing is checked against the dequantized parts concatenated / permuted in numpy, bit for bit; the
search against the reference amax-only quantizers (never a larger error, and a smaller one overall).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tpuserve.quant import fp4, fp8, fuse, search


def _w(k: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((k, n)) * np.exp(rng.uniform(-3, 1, (1, n)))).astype(np.float32)


def _deq(rec):
    if isinstance(rec, fp8.Fp8Weight):
        return np.asarray(fp8.dequantize_fp8(rec))
    if isinstance(rec, fp4.Mxfp4Weight):
        return np.asarray(fp4.dequantize_mxfp4(rec))
    return np.asarray(fp4.dequantize_nvfp4(rec))


QUANTIZERS = {
    "fp8-tensor": lambda w: fp8.quantize_fp8(w, "tensor"),
    "fp8-block": lambda w: fp8.quantize_fp8(w, "block", block_size=128),
    "mxfp4": fp4.quantize_mxfp4,
    "nvfp4": fp4.quantize_nvfp4,  # one global per part: the fused record keeps one per column
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_concat_and_permute_columns_exactly(kind):
    parts = [QUANTIZERS[kind](jnp.asarray(_w(256, n, i))) for i, n in enumerate((192, 64, 64))]
    fused = fuse.concat_out(parts)
    want = np.concatenate([_deq(p) for p in parts], axis=-1)
    np.testing.assert_array_equal(_deq(fused), want)
    perm = np.random.default_rng(0).permutation(want.shape[1])
    taken = fuse.take_out(fused, perm, (4, 80))
    np.testing.assert_array_equal(_deq(taken), want[:, perm].reshape(256, 4, 80))
    if kind == "nvfp4":
        assert fused.global_scale.shape == (1, 320)  # the parts' globals differ


@pytest.mark.timeout(120)
def test_equal_nvfp4_globals_stay_one_scalar_and_types_must_match():
    a = fp4.quantize_nvfp4(jnp.asarray(_w(64, 32, 1)))
    b = fp4.Nvfp4Weight(a.packed, a.scale, a.global_scale, a.out_shape)
    assert fuse.concat_out([a, b]).global_scale.shape == (1, 1)
    with pytest.raises(ValueError, match="different types"):
        fuse.concat_out([a, fp4.quantize_mxfp4(jnp.asarray(_w(64, 32, 2)))])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_scale_search_never_worse_per_block_and_better_overall(kind):
    w = _w(512, 96, 5)
    ref = (fp4.quantize_mxfp4 if kind == "mxfp4" else fp4.quantize_nvfp4)(jnp.asarray(w))
    got = (search.quantize_mxfp4_search if kind == "mxfp4" else search.quantize_nvfp4_search)(jnp.asarray(w))
    assert type(got) is type(ref) and got.packed.shape == ref.packed.shape
    assert got.scale.dtype == ref.scale.dtype and got.scale.shape == ref.scale.shape
    block = ref.block
    err_ref = ((_deq(ref) - w) ** 2).reshape(-1, block, 96).sum(1)
    err_got = ((_deq(got) - w) ** 2).reshape(-1, block, 96).sum(1)
    assert (err_got <= err_ref * (1 + 1e-6) + 1e-30).all()
    assert err_got.sum() < 0.97 * err_ref.sum()

"""Quantized weight formats against independent oracles, bit for bit.

Oracles: torchao (``MXTensor``, ``NVFP4Tensor``, ``nvfp4_quantize``, its fp4 cast), compressed-tensors
(its own scale math and compressors write the checkpoints, its decompressors read them back),
transformers (block-FP8 dequant, gpt-oss MXFP4 decode), gguf (MXFP4 / NVFP4 block codecs) and torch's
saturating fp8 cast. Our records are ``[in, out]``; oracles are ``[out, in]``, hence the ``.T``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

pytest.importorskip("torchao")
pytest.importorskip("compressed_tensors")

import ct_oracle as ct
import gguf
from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tpuserve.quant import codecs, fp4, fp8


def bits(a) -> np.ndarray:
    """Exact comparison key: the f32 bit pattern (so -0.0 != 0.0 and NaNs compare by payload)."""
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def weight(out: int, k: int, seed: int = 0) -> np.ndarray:
    """f32 ``[out, in]`` with rows of very different magnitude (exercises scale selection)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, k)) * np.exp(rng.uniform(-4, 2, (out, 1)))
    w[0, :32] = [5.0] + [1.0] * 31  # OCP MX example: scale 1, 5 -> 4
    w[1, :32] = [7.0] + [0.0] * 31  # saturates 7 -> 6 under floor scaling
    w[2, :] = 0.0  # an all-zero row
    return w.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# codecs


@pytest.mark.timeout(120)
def test_kernel_decoders_match_dtype_decoders_on_every_code():
    codes = jnp.arange(16, dtype=jnp.int32)
    assert np.array_equal(bits(codecs.e2m1_bits_decode(codes)), bits(codecs.e2m1_lut_decode(codes)))
    assert np.array_equal(
        bits(codecs.e2m1_lut_decode(codes)), bits(np.arange(16, dtype=np.uint8).view(jnp.float4_e2m1fn))
    )
    allb = np.arange(256, dtype=np.uint8)
    ref = allb.view(jnp.float8_e4m3fn).astype(np.float32)
    got = np.asarray(codecs.e4m3_bits_decode(jnp.asarray(allb)))
    finite = ~np.isnan(ref)
    assert np.array_equal(bits(got[finite]), bits(ref[finite]))
    e8 = np.asarray(codecs.e8m0_decode(jnp.asarray(allb)))
    ref8 = allb.view(jnp.float8_e8m0fnu).astype(np.float32)
    assert np.array_equal(bits(e8), bits(ref8))
    assert np.array_equal(
        bits(np.asarray(codecs.e8m0_bits_decode(jnp.asarray(allb)))[1:255]), bits(ref8[1:255])
    )


@pytest.mark.timeout(120)
def test_e2m1_encode_matches_torchao_cast():
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [
            rng.uniform(-8, 8, 4000),
            [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.5, -100.0, 0.0, -0.0, 1e-30],
        ]
    ).astype(np.float32)
    want = f32_to_f4_unpacked(torch.from_numpy(x)).numpy()
    got = np.asarray(codecs.e2m1_encode(jnp.asarray(x)))
    # torchao keeps the sign of values that round to zero (code 8 = -0); so do we
    assert np.array_equal(got, want)


@pytest.mark.timeout(120)
def test_e4m3_cast_saturates_like_torch():
    x = np.array(
        [0.0, 1.0, 447.0, 464.0, 465.0, 480.0, 1000.0, 1e30, -480.0, -np.inf, np.inf, 2.0**-10, 3e-3],
        np.float32,
    )
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    got = np.asarray(codecs.to_e4m3(jnp.asarray(x))).view(np.uint8)
    assert np.array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# FP8

CT_FP8 = [("FP8", "tensor"), ("FP8_DYNAMIC", "channel"), ("FP8_BLOCK", "block")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preset,granularity", CT_FP8)
def test_fp8_compressed_tensors_checkpoint_dequant_and_quantize(preset, granularity):
    w = weight(200, 320)  # ragged 128-blocks on both axes
    sd = ct.compress(torch.from_numpy(w), preset)
    want = ct.decompress(sd, preset).float().numpy()
    block = ct.scheme(preset).weights.block_structure
    rec = fp8.fp8_from_checkpoint(
        sd["weight"].view(torch.uint8).numpy().view(jnp.float8_e4m3fn),
        sd["weight_scale"].numpy(),
        block_size=block,
    )
    assert rec.granularity == granularity
    assert np.array_equal(bits(fp8.dequantize_fp8(rec)), bits(want.T))
    # our online quantizer writes the same bytes and scales compressed-tensors does
    ours = fp8.quantize_fp8(jnp.asarray(w.T), granularity, block_size=128)
    assert np.array_equal(np.asarray(ours.qweight).view(np.uint8), np.asarray(rec.qweight).view(np.uint8))
    assert np.array_equal(bits(ours.scale), bits(rec.scale))


@pytest.mark.timeout(120)
def test_fp8_hf_block_dequant_matches_transformers():
    rng = np.random.default_rng(3)
    q = torch.from_numpy(rng.uniform(-448, 448, (200, 300)).astype(np.float32)).to(torch.float8_e4m3fn)
    s = torch.from_numpy(np.exp(rng.uniform(-12, 0, (2, 3))).astype(np.float32))
    want = _dequantize_fp8_weight(q.clone(), s, [128, 128], torch.float32).numpy()
    rec = fp8.fp8_from_checkpoint(
        q.view(torch.uint8).numpy().view(jnp.float8_e4m3fn), s.numpy(), block_size=[128, 128]
    )
    assert np.array_equal(bits(fp8.dequantize_fp8(rec)), bits(want.T))


@pytest.mark.timeout(120)
def test_fp8_quantize_saturates_instead_of_nan():
    # one block where rounding w/scale lands between 448 and 464 would be fine anyway; force a
    # scale too small for the block (as a checkpoint with a stale scale would have) via a record
    w = jnp.asarray(weight(64, 96).T)
    rec = fp8.quantize_fp8(w, "channel")
    assert not np.isnan(np.asarray(rec.qweight.astype(jnp.float32))).any()
    assert float(jnp.max(jnp.abs(rec.qweight.astype(jnp.float32)))) == 448.0
    x = codecs.to_e4m3(jnp.asarray([1e6, -1e6, 500.0]))
    assert np.asarray(x.astype(jnp.float32)).tolist() == [448.0, -448.0, 448.0]


# ---------------------------------------------------------------------------------------------
# MXFP4


@pytest.mark.timeout(120)
def test_mxfp4_quantize_and_dequant_match_torchao():
    w = weight(48, 128)
    mx = MXTensor.to_mx(torch.from_numpy(w), torch.float4_e2m1fn_x2, block_size=32)
    rec = fp4.quantize_mxfp4(jnp.asarray(w.T))
    assert np.array_equal(np.asarray(rec.packed).T, mx.qdata.view(torch.uint8).numpy())
    assert np.array_equal(np.asarray(rec.scale).T, mx.scale.view(torch.uint8).numpy())
    assert np.array_equal(bits(fp4.dequantize_mxfp4(rec)), bits(mx.dequantize(torch.float32).numpy().T))
    assert float(fp4.dequantize_mxfp4(rec)[0, 0]) == 4.0 and float(fp4.dequantize_mxfp4(rec)[0, 1]) == 6.0


@pytest.mark.timeout(120)
def test_mxfp4_compressed_tensors_checkpoint():
    w = weight(40, 96, seed=5)
    sd = ct.compress(torch.from_numpy(w), "MXFP4")
    want = ct.decompress(sd, "MXFP4")  # bf16: every MXFP4 value is exact in bf16
    rec = fp4.mxfp4_from_checkpoint(sd["weight_packed"].numpy(), sd["weight_scale"].numpy())
    got = fp4.dequantize_mxfp4(rec)
    assert np.array_equal(bits(got), bits(want.float().numpy().T))


@pytest.mark.timeout(120)
def test_mxfp4_gpt_oss_layout_matches_transformers():
    rng = np.random.default_rng(7)
    e, out, k = 2, 24, 64
    blocks = rng.integers(0, 256, (e, out, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(110, 135, (e, out, k // 32), dtype=np.uint8)
    want = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    ).numpy()  # [E, in, out]
    rec = fp4.mxfp4_from_checkpoint(blocks.reshape(e, out, k // 2), scales)
    assert np.array_equal(bits(fp4.dequantize_mxfp4(rec)), bits(want))


@pytest.mark.timeout(120)
def test_mxfp4_gguf_split_halves():
    w = weight(16, 96, seed=9)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    rec = fp4.mxfp4_from_gguf(raw, w.shape)
    assert np.array_equal(bits(fp4.dequantize_mxfp4(rec)), bits(want.T))


# ---------------------------------------------------------------------------------------------
# NVFP4


@pytest.mark.timeout(120)
def test_nvfp4_quantize_and_dequant_match_torchao():
    w = weight(48, 128, seed=11)
    g = per_tensor_amax_to_scale(torch.tensor(np.abs(w).max()))
    s, q = nvfp4_quantize(torch.from_numpy(w), 16, g)
    rec = fp4.quantize_nvfp4(jnp.asarray(w.T))
    assert not rec.global_divides
    assert np.array_equal(np.asarray(rec.packed).T, q.view(torch.uint8).numpy())
    assert np.array_equal(np.asarray(rec.scale).T.view(np.uint8), s.view(torch.uint8).numpy())
    assert np.array_equal(bits(rec.global_scale.reshape(())), bits(g.numpy()))
    t = NVFP4Tensor.to_nvfp4(torch.from_numpy(w), per_tensor_scale=g)
    assert np.array_equal(bits(fp4.dequantize_nvfp4(rec)), bits(t.dequantize(torch.float32).numpy().T))


@pytest.mark.timeout(120)
def test_nvfp4_compressed_tensors_checkpoint_inverted_global_scale():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    w = weight(40, 96, seed=13)
    sd = ct.compress(torch.from_numpy(w), "NVFP4")
    gs = sd["weight_global_scale"]
    assert float(gs) > 1.0  # 2688 / amax: the reciprocal of ModelOpt's weight_scale_2
    rec = fp4.nvfp4_from_checkpoint(
        sd["weight_packed"].numpy(),
        sd["weight_scale"].view(torch.uint8).numpy().view(jnp.float8_e4m3fn),
        gs.numpy(),
        global_divides=True,
    )
    got = fp4.dequantize_nvfp4(rec)
    # 1) the compressor's own decompress (bf16 output)
    want_bf16 = ct.decompress(sd, "NVFP4")
    assert np.array_equal(
        bits(np.asarray(got.astype(jnp.bfloat16), np.float32)), bits(want_bf16.float().numpy().T)
    )
    # 2) its dequantize in f32, bit for bit
    unpacked = unpack_fp4_from_uint8(sd["weight_packed"], 40, 96, dtype=torch.float32)
    want = dequantize(
        unpacked,
        sd["weight_scale"].to(torch.float32),
        args=ct.scheme("NVFP4").weights,
        global_scale=gs,
        dtype=torch.float32,
    )
    assert np.array_equal(bits(got), bits(want.numpy().T))
    # the same bytes read with the ModelOpt convention would be wildly off: the flag matters
    wrong = dataclass_replace(rec, global_divides=False)
    assert not np.allclose(np.asarray(fp4.dequantize_nvfp4(wrong)), np.asarray(got))


def dataclass_replace(rec, **kw):
    import dataclasses

    return dataclasses.replace(rec, **kw)


@pytest.mark.timeout(120)
def test_nvfp4_modelopt_checkpoint_matches_torchao():
    # ModelOpt tensors are exactly torchao's (weight, weight_scale, weight_scale_2 = amax/2688)
    w = weight(32, 64, seed=17)
    g = per_tensor_amax_to_scale(torch.tensor(np.abs(w).max()))
    s, q = nvfp4_quantize(torch.from_numpy(w), 16, g)
    rec = fp4.nvfp4_from_checkpoint(
        q.view(torch.uint8).numpy(),
        s.view(torch.uint8).numpy().view(jnp.float8_e4m3fn),
        g.numpy(),
        global_divides=False,
    )
    t = NVFP4Tensor.to_nvfp4(torch.from_numpy(w), per_tensor_scale=g)
    assert np.array_equal(bits(fp4.dequantize_nvfp4(rec)), bits(t.dequantize(torch.float32).numpy().T))


@pytest.mark.timeout(120)
def test_nvfp4_gguf():
    # gguf 0.19 decodes NVFP4 but has no quantizer: random blocks, with the odd scale bytes
    # (0x7F reads as 0, the sign bit is ignored) planted
    rng = np.random.default_rng(19)
    out, k = 16, 128
    raw = rng.integers(0, 256, (out, k // 64, 36), dtype=np.uint8)
    raw[..., :4] = rng.integers(0x20, 0x60, (out, k // 64, 4), dtype=np.uint8)
    raw[0, 0, :4] = [0x7F, 0xB8, 0x00, 0x01]
    want = gguf.quants.dequantize(raw.reshape(out, -1), gguf.GGMLQuantizationType.NVFP4)
    rec = fp4.nvfp4_from_gguf(raw, (out, k))
    got = np.asarray(fp4.dequantize_nvfp4(rec))
    # gguf's value table is integers, so code 8 (-0) comes out +0; every other bit matches
    assert np.array_equal(bits(got + 0.0), bits(want.T + 0.0))


# ---------------------------------------------------------------------------------------------
# records as pytrees: stacked layers, several output axes, scan


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_channel", "mxfp4", "nvfp4"])
def test_stacked_records_slice_like_their_layers(fmt):
    rng = np.random.default_rng(23)
    w = jnp.asarray(rng.standard_normal((3, 64, 2, 5, 8)).astype(np.float32))  # [L, K, *out]
    quant = {
        "fp8_block": lambda a, n: fp8.quantize_fp8(a, "block", block_size=32, num_lead=n),
        "fp8_channel": lambda a, n: fp8.quantize_fp8(a, "channel", num_lead=n),
        "mxfp4": lambda a, n: fp4.quantize_mxfp4(a, num_lead=n),
        "nvfp4": lambda a, n: fp4.quantize_nvfp4(a, num_lead=n),
    }[fmt]
    deq = {
        "fp8_block": fp8.dequantize_fp8,
        "fp8_channel": fp8.dequantize_fp8,
        "mxfp4": fp4.dequantize_mxfp4,
        "nvfp4": fp4.dequantize_nvfp4,
    }[fmt]
    stacked = quant(w, 1)
    assert deq(stacked).shape == w.shape

    def body(c, layer_rec):
        return c, deq(layer_rec)

    _, per_layer = jax.jit(lambda r: jax.lax.scan(body, 0, r))(stacked)
    for i in range(3):
        assert np.array_equal(bits(per_layer[i]), bits(deq(quant(w[i], 0))))

"""Pallas TPU quantized matmuls in TPU interpret mode (race detection on) against their references.

The references (``fp8_matmul_ref``, ``fp4_matmul_ref``) are the formats' exact dequant followed by
an f32 GEMM; that dequant is held bit-exact against the oracles in test_quant_formats.py. Grids
are tiny (interpret mode costs milliseconds per step) but cover several M, N and K tiles, row
padding, ragged FP8 edge blocks, several scale rows per K tile and one scale row across K tiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_interpret import RACES, fresh_interpreter, races_found  # noqa: F401 (autouse fixture)

from tpuserve.quant import fp4, fp8
from tpuserve.quant.pallas_tpu_matmul import (
    FP4_DECODES,
    fp4_matmul_ref,
    fp4_matmul_tpu,
    fp8_matmul_ref,
    fp8_matmul_tpu,
)


def data(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) * np.exp(rng.uniform(-2, 2, (1, n))) / np.sqrt(k)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w)


def check(y, want, dtype=jnp.float32):
    assert not races_found(), "the race detector reported a data race"
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=3e-2)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(y, np.float32) / scale, np.asarray(want, np.float32) / scale, **tol)


# name: (M, K, N, quantize kwargs, tiles)
FP8_CASES = {
    # one scale row; it stays the same across the 2 K tiles (bk = K > tk)
    "channel_w8a16": (10, 256, 256, dict(granularity="channel"), dict(block_k=128, block_n=128)),
    "tensor_w8a16": (8, 128, 384, dict(granularity="tensor"), dict(block_n=128)),
    # 2 scale rows per K tile (tk = 256, bk = 128), 2 K tiles, 3 M tiles with padding
    "block_w8a16": (20, 512, 256, dict(granularity="block"), dict(block_m=8, block_k=256, block_n=128)),
    # ragged 128-blocks in K (320) and N (200): one full-K tile with a 64-row last sub-block
    "block_ragged_w8a16": (6, 320, 200, dict(granularity="block"), dict()),
    "block_w8a8": (12, 256, 256, dict(granularity="block", act_quant=True), dict(block_k=128, block_n=128)),
    "channel_w8a8": (12, 256, 128, dict(granularity="channel", act_quant=True), dict(block_k=128)),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_kernel_matches_reference(name):
    m, k, n, qkw, tiles = FP8_CASES[name]
    x, w = data(m, k, n)
    rec = fp8.quantize_fp8(w, block_size=128, **qkw)
    y = fp8_matmul_tpu(x, rec, interpret=RACES, **tiles)
    jax.block_until_ready(y)
    check(y, fp8_matmul_ref(x, rec))


@pytest.mark.timeout(300)
def test_fp8_kernel_bf16_activations():
    x, w = data(16, 256, 256, seed=3)
    rec = fp8.quantize_fp8(w, "block", block_size=128)
    xb = x.astype(jnp.bfloat16)
    y = fp8_matmul_tpu(xb, rec, block_k=128, block_n=128, interpret=RACES)
    assert y.dtype == jnp.bfloat16
    check(y, fp8_matmul_ref(xb.astype(jnp.float32), rec), jnp.bfloat16)


FP4_CASES = {
    "mxfp4_3k_tiles": ("mx", 10, 384, 256, dict(block_k=128, block_n=128)),
    "mxfp4_full_k": ("mx", 8, 256, 128, dict()),
    "nvfp4_2k_tiles": ("nv", 20, 256, 256, dict(block_m=8, block_k=128, block_n=128)),
    "nvfp4_full_k": ("nv", 4, 128, 384, dict(block_n=128)),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("decode", FP4_DECODES)
@pytest.mark.parametrize("name", list(FP4_CASES))
def test_fp4_kernel_matches_reference(name, decode):
    kind, m, k, n, tiles = FP4_CASES[name]
    x, w = data(m, k, n, seed=5)
    rec = fp4.quantize_mxfp4(w) if kind == "mx" else fp4.quantize_nvfp4(w)
    y = fp4_matmul_tpu(x, rec, decode=decode, interpret=RACES, **tiles)
    jax.block_until_ready(y)
    check(y, fp4_matmul_ref(x, rec))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("m", [1, 8, 130])
@pytest.mark.parametrize("decode", FP4_DECODES)
@pytest.mark.parametrize("kind", ["mx", "nv"])
def test_fp4_decodes_rows_and_k_tiles(kind, decode, m):
    """Every decode at one decode row, 8 and 130 (a padded 136-row tile), 3 K tiles of 128, 2 N
    tiles; bf16 activations (what the chip runs) against the f32 reference of the same x."""
    x, w = data(m, 384, 256, seed=13)
    rec = fp4.quantize_mxfp4(w) if kind == "mx" else fp4.quantize_nvfp4(w)
    xb = x.astype(jnp.bfloat16)
    y = fp4_matmul_tpu(
        xb, rec, out_dtype=jnp.float32, block_k=128, block_n=128, decode=decode, interpret=RACES
    )
    jax.block_until_ready(y)
    check(y, fp4_matmul_ref(xb.astype(jnp.float32), rec, out_dtype=jnp.float32))


@pytest.mark.timeout(60)
def test_unknown_fp4_decode_is_refused():
    x, w = data(8, 256, 128)
    with pytest.raises(ValueError, match="decode"):
        fp4_matmul_tpu(x, fp4.quantize_mxfp4(w), decode="lut")


@pytest.mark.timeout(300)
def test_nvfp4_kernel_compressed_tensors_convention():
    # a dividing global scale (compressed-tensors' weight_global_scale): same bytes, inverted number
    x, w = data(8, 256, 128, seed=7)
    rec = fp4.quantize_nvfp4(w)
    ct_rec = fp4.Nvfp4Weight(rec.packed, rec.scale, 1.0 / rec.global_scale, rec.out_shape, True)
    y = fp4_matmul_tpu(x, ct_rec, block_k=128, interpret=RACES)
    jax.block_until_ready(y)
    check(y, fp4_matmul_ref(x, ct_rec))
    check(y, fp4_matmul_ref(x, rec))


@pytest.mark.timeout(300)
def test_rotated_mxfp4_through_quant_linear_matches_reference():
    # the calibrated quantizer's rotated records: quant_linear rotates x, then the same kernel runs
    import dataclasses

    from tpuserve.quant.dispatch import quant_linear

    x, w = data(8, 256, 128, seed=11)
    rec = dataclasses.replace(fp4.quantize_mxfp4(fp4.hadamard_blocks(w, axis=-2)), rotated=True)
    y = quant_linear(x, rec, impl="pallas_tpu", interpret=RACES)
    jax.block_until_ready(y)
    assert not races_found()
    check(y, fp4_matmul_ref(x, rec))
    with pytest.raises(ValueError, match="rotated"):
        fp4_matmul_tpu(x, rec, interpret=RACES)


@pytest.mark.timeout(300)
def test_fp4_kernel_bf16_activations():
    x, w = data(16, 256, 128, seed=9)
    rec = fp4.quantize_mxfp4(w)
    xb = x.astype(jnp.bfloat16)
    y = fp4_matmul_tpu(xb, rec, block_k=128, interpret=RACES)
    assert y.dtype == jnp.bfloat16
    check(y, fp4_matmul_ref(xb.astype(jnp.float32), rec), jnp.bfloat16)


@pytest.mark.timeout(60)
def test_bad_tiles_are_refused():
    x, w = data(8, 256, 128)
    with pytest.raises(ValueError, match="block_k"):
        fp8_matmul_tpu(x, fp8.quantize_fp8(w, "block", block_size=128), block_k=192)
    with pytest.raises(ValueError, match="block_k"):
        fp4_matmul_tpu(x, fp4.quantize_mxfp4(w), block_k=48)


# A layer scan's weights: the record stacked over layers, the layer a traced scalar (scan counter).
STACKED = {
    "fp8_channel": lambda w: fp8.quantize_fp8(w, "channel"),
    "fp8_block": lambda w: fp8.quantize_fp8(w, "block", block_size=128),
    "mxfp4": fp4.quantize_mxfp4,
    "nvfp4": fp4.quantize_nvfp4,
}


def _stack(recs):
    return jax.tree.map(lambda *a: jnp.stack(a), *recs)


STACKED_DECODES = [(name, None) for name in STACKED if name.startswith("fp8")] + [
    (name, decode) for name in STACKED if not name.startswith("fp8") for decode in FP4_DECODES
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,decode", STACKED_DECODES)
def test_stacked_record_reads_the_scanned_layer(name, decode):
    """The kernels take a record stacked over 3 layers and a traced layer index (what the decoder's
    scan hands them, tpu_platform/linear.py LayerOfStack): each scan step must multiply by its own
    layer, so equal layers or a layer index ignored fail."""
    quantize = STACKED[name]
    x, _ = data(12, 256, 256, seed=5)
    recs = [quantize(data(1, 256, 256, seed=10 + i)[1]) for i in range(3)]
    stacked = _stack(recs)
    if name.startswith("fp8"):
        matmul, reference = fp8_matmul_tpu, fp8_matmul_ref
    else:
        matmul, reference = functools.partial(fp4_matmul_tpu, decode=decode), fp4_matmul_ref

    @jax.jit
    def scanned(x, w):
        def body(carry, layer):
            return carry, matmul(x, w, layer=layer, block_k=128, block_n=128, interpret=RACES)

        return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

    ys = jax.block_until_ready(scanned(x, stacked))
    for i, rec in enumerate(recs):
        check(ys[i], reference(x, rec))
        check(reference(x, stacked, layer=jnp.int32(i)), reference(x, rec))  # the ref's slice too
    assert float(jnp.max(jnp.abs(ys[0] - ys[1]))) > 1e-3  # the layers differ, so the index mattered


@pytest.mark.timeout(60)
def test_stacked_record_needs_its_layer():
    x, w = data(8, 256, 128)
    rec = fp8.quantize_fp8(w, "channel")
    with pytest.raises(ValueError, match="needs the layer"):
        fp8_matmul_tpu(x, _stack([rec, rec]))
    with pytest.raises(ValueError, match="not stacked"):
        fp4_matmul_tpu(x, fp4.quantize_mxfp4(w), layer=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(STACKED))
@pytest.mark.parametrize("stacked", [False, True])
def test_kernels_export_for_tpu(name, stacked):
    """Interpret mode never runs Mosaic: lower each kernel for TPU from CPU (jax.export), on the
    Llama-1B shape's gate_up (K 2048, N 16384), bf16 activations, one decode row and 128 rows."""
    k, n, layers = 2048, 16384, 16
    quantize = STACKED[name]
    rec = jax.eval_shape(quantize, jax.ShapeDtypeStruct((k, n), jnp.float32))
    if stacked:
        rec = jax.tree.map(lambda a: jax.ShapeDtypeStruct((layers, *a.shape), a.dtype), rec)
    matmul = fp8_matmul_tpu if name.startswith("fp8") else fp4_matmul_tpu
    for m in (1, 128):
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        if stacked:
            fn = jax.jit(lambda x, w, layer: matmul(x, w, layer=layer))
            args = (x, rec, jax.ShapeDtypeStruct((), jnp.int32))
        else:
            fn = jax.jit(lambda x, w: matmul(x, w))
            args = (x, rec)
        exported = jax.export.export(fn, platforms=["tpu"])(*args)
        assert "tpu_custom_call" in exported.mlir_module()
        assert exported.out_avals[0].shape == (m, n)


# Llama-1B's and Llama-8B's FP4 matmuls (K, N): gate_up and down (the widest K)
EXPORT_SHAPES = {"llama-1b": [(2048, 16384), (8192, 2048)], "llama-8b": [(4096, 28672), (14336, 4096)]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("decode", FP4_DECODES)
@pytest.mark.parametrize("kind", ["mx", "nv"])
@pytest.mark.parametrize("shape", list(EXPORT_SHAPES))
def test_fp4_decodes_export_for_tpu(shape, kind, decode):
    """Each decode lowered for TPU (jax.export) at the 1B and 8B shapes, stacked over layers with a
    traced layer, one decode row and 128 rows."""
    quantize = fp4.quantize_mxfp4 if kind == "mx" else fp4.quantize_nvfp4
    for k, n in EXPORT_SHAPES[shape]:
        rec = jax.eval_shape(quantize, jax.ShapeDtypeStruct((k, n), jnp.float32))
        rec = jax.tree.map(lambda a: jax.ShapeDtypeStruct((4, *a.shape), a.dtype), rec)
        for m in (1, 128):
            fn = jax.jit(lambda x, w, layer: fp4_matmul_tpu(x, w, layer=layer, decode=decode))
            x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
            exported = jax.export.export(fn, platforms=["tpu"])(x, rec, jax.ShapeDtypeStruct((), jnp.int32))
            assert "tpu_custom_call" in exported.mlir_module()
            assert exported.out_avals[0].shape == (m, n)


def test_kernels_ask_mosaic_for_more_scoped_vmem():
    """On a v5e the Llama-8B shape's FP8 down projection (K 14336, per-channel scales) needed
    17-22 MB of scoped VMEM at 128-256 rows, over Mosaic's 16 MiB default, and the 8B model failed
    to warm up; the NVFP4 kernel's 1024-wide N tiles at the 1B down projection (K 8192) asked for
    18 MB. Each exported call must carry the kernels' own limit (scoped_memory_configs)."""
    from tpuserve.quant.pallas_tpu_matmul import _VMEM_LIMIT

    assert _VMEM_LIMIT > 16 * 1024 * 1024
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    rec = jax.eval_shape(fp8.quantize_fp8, jax.ShapeDtypeStruct((14336, 4096), jnp.float32))
    rec = jax.tree.map(lambda a: jax.ShapeDtypeStruct((2, *a.shape), a.dtype), rec)
    fn = jax.jit(lambda x, w, layer: fp8_matmul_tpu(x, w, layer=layer))
    x = jax.ShapeDtypeStruct((256, 14336), jnp.bfloat16)
    text = jax.export.export(fn, platforms=["tpu"])(x, rec, layer).mlir_module()
    assert f"\\22size\\22: {_VMEM_LIMIT}" in text
    nv = jax.eval_shape(fp4.quantize_nvfp4, jax.ShapeDtypeStruct((8192, 2048), jnp.float32))
    fn = jax.jit(lambda x, w: fp4_matmul_tpu(x, w))
    text = jax.export.export(fn, platforms=["tpu"])(
        jax.ShapeDtypeStruct((8, 8192), jnp.bfloat16), nv
    ).mlir_module()
    assert f"\\22size\\22: {_VMEM_LIMIT}" in text


def _ops_on(closed, avals) -> list[str]:
    """Primitives outside Pallas kernels that take an operand of one of ``avals`` ((shape, dtype))."""
    names = []
    for e in closed.jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            continue
        if any((getattr(v.aval, "shape", None), getattr(v.aval, "dtype", None)) in avals for v in e.invars):
            names.append(e.primitive.name)
    return names


@pytest.mark.timeout(300)
def test_nvfp4_scale_bytes_reach_the_kernel_untouched():
    """A TPU engine holds NVFP4 scales as their u8 bytes (fp4.scales_as_bytes): the kernel takes
    them as they are, with the same result as the float8 record. With float8 scales the bitcast
    to bytes outside the kernel was a copy on XLA:TPU every step (the 1B shape wrote 58 MiB of
    scale copies a step: benchmarks/hlo_param_copies.py on the chip's dump, 2026-12-07)."""
    x, w = data(4, 256, 128, seed=3)
    rec = fp4.quantize_nvfp4(w)
    as_bytes = fp4.scales_as_bytes({"w": rec})["w"]
    assert rec.scale.dtype == jnp.float8_e4m3fn and as_bytes.scale.dtype == jnp.uint8
    assert fp4.scales_as_bytes({"w": as_bytes})["w"].scale is as_bytes.scale  # once only
    np.testing.assert_array_equal(fp4.dequantize_nvfp4(as_bytes), fp4.dequantize_nvfp4(rec))
    y = fp4_matmul_tpu(x, as_bytes, block_k=128, interpret=RACES)
    check(y, fp4_matmul_ref(x, rec))

    layers = 3
    stack = jax.tree.map(lambda a: jax.ShapeDtypeStruct((layers, *a.shape), a.dtype), as_bytes)
    scale = (stack.scale.shape, stack.scale.dtype)
    fn = lambda x, w, layer: fp4_matmul_tpu(x, w, layer=layer)  # noqa: E731
    closed = jax.make_jaxpr(fn)(
        jax.ShapeDtypeStruct((1, 256), jnp.bfloat16), stack, jax.ShapeDtypeStruct((), jnp.int32)
    )
    assert _ops_on(closed, {scale}) == []
    kernel = next(e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call")
    assert scale in {(v.aval.shape, v.aval.dtype) for v in kernel.invars}
    # the float8 record (what CPU engines keep) still goes through the bitcast: the test can tell
    f8 = jax.tree.map(lambda a: jax.ShapeDtypeStruct((layers, *a.shape), a.dtype), rec)
    closed = jax.make_jaxpr(fn)(
        jax.ShapeDtypeStruct((1, 256), jnp.bfloat16), f8, jax.ShapeDtypeStruct((), jnp.int32)
    )
    assert _ops_on(closed, {(f8.scale.shape, f8.scale.dtype)}) == ["bitcast_convert_type"]


@pytest.mark.parametrize("decode", FP4_DECODES)
@pytest.mark.parametrize("blk", [32, 16])  # MXFP4, NVFP4
def test_fp4_k_tiles_slice_scales_at_whole_u8_tiles(blk, decode):
    """Every K tile the kernels pick for the 1B / 8B / gpt-oss matmuls starts its scale rows at a
    multiple of the u8 tile (32 rows) or takes all of K: a v5e's Mosaic refused the 8B down
    projection's 3584-wide tile (112 scale rows, E2003 unprovable alignment). Interpret mode and
    jax.export never run that check, so it is asserted on the tile itself."""
    from tpuserve.quant.pallas_tpu_matmul import fp4_k_tile

    swar = decode.startswith("swar")
    for k in (2048, 8192, 4096, 14336, 2880, 28672, 5760):
        tk = fp4_k_tile(k, blk, swar)
        assert k % tk == 0
        assert tk == k or (tk // blk) % 32 == 0, (k, tk)
    with pytest.raises(ValueError, match="multiple of 32, the u8 sublane tile"):
        fp4_k_tile(14336, blk, swar, block_k=3584 if blk == 32 else 1792)
    assert fp4_k_tile(256, blk, swar, block_k=128, compiled=False) == 128  # interpret: any tile


def test_fp4_n_tiles_widen_for_decode_rows_only():
    """Row tiles up to 128 take N tiles up to 1024 (fewer grid steps: the 8B shape's MXFP4
    matmuls at M 1 ran 3% faster on a v5e); larger row tiles keep 512, and an explicit block_n
    always wins."""
    from tpuserve.quant.pallas_tpu_matmul import fp4_n_tile

    assert fp4_n_tile(14336 * 2, 16) == 1024  # 8B gate_up at M 1 (bf16 rows: a 16-row tile)
    assert fp4_n_tile(4096, 32) == 1024
    assert fp4_n_tile(4096, 128) == 1024 and fp4_n_tile(4096, 256) == 512
    assert fp4_n_tile(3072, 16) == 1024 and fp4_n_tile(2560, 16) == 640  # the widest divisor <= 1024
    assert fp4_n_tile(4096, 16, block_n=256) == 256


@pytest.mark.timeout(300)
@pytest.mark.parametrize("m", [1, 8, 130])
@pytest.mark.parametrize("kind", ["mx", "nv"])
def test_tiled_k_order_takes_x_as_it_is(kind, m):
    """A record whose codes are in the kernel's tiled K order (fp4.tile_k_order) gives the same
    product from x in natural order as the plain record does from x permuted: 3 K tiles of 128, 2
    N tiles, one stacked layer picked by index; NVFP4 with some negative block scales (each output
    flips its own signs) against the reference dequant of the same bytes."""
    x, w = data(m, 384, 256, seed=17)
    rec = fp4.quantize_mxfp4(w) if kind == "mx" else fp4.quantize_nvfp4(w)
    if kind == "nv":  # e4m3 sign bit on every third scale: the per-output flip
        flip = (jnp.arange(rec.scale.size).reshape(rec.scale.shape) % 3 == 0).astype(jnp.uint8) << 7
        rec = dataclasses.replace(rec, scale=fp4.scales_as_bytes(rec).scale | flip)
    tiled = fp4.tile_k_order(rec, 128)
    assert tiled.k_tile == 128 and tiled.packed.shape == rec.packed.shape
    np.testing.assert_array_equal(
        fp4.dequantize_mxfp4(tiled) if kind == "mx" else fp4.dequantize_nvfp4(tiled),
        fp4.dequantize_mxfp4(rec) if kind == "mx" else fp4.dequantize_nvfp4(rec),
    )
    stacked = jax.tree.map(lambda a: jnp.stack([a, a[::-1]]), tiled)  # layer 1: other bytes, same order
    xb = x.astype(jnp.bfloat16)
    want = fp4_matmul_ref(xb.astype(jnp.float32), rec, out_dtype=jnp.float32)
    y = fp4_matmul_tpu(xb, tiled, out_dtype=jnp.float32, block_n=128, interpret=RACES)
    check(y, want)
    y1 = fp4_matmul_tpu(xb, stacked, out_dtype=jnp.float32, block_n=128, layer=jnp.int32(1), interpret=RACES)
    check(y1, fp4_matmul_ref(xb.astype(jnp.float32), stacked, out_dtype=jnp.float32, layer=1))


def test_tiled_k_order_refusals():
    x, w = data(8, 256, 128)
    tiled = fp4.tile_k_order(fp4.quantize_mxfp4(w), 128)
    with pytest.raises(ValueError, match="already tiled"):
        fp4.tile_k_order(tiled, 128)
    with pytest.raises(ValueError, match="takes a SWAR decode and its own K tile"):
        fp4_matmul_tpu(x, tiled, decode="f32", interpret=RACES)
    with pytest.raises(ValueError, match="takes a SWAR decode and its own K tile"):
        fp4_matmul_tpu(x, tiled, block_k=256, interpret=RACES)
    from tpuserve.quant.linear_xla import fp4_linear_xla

    with pytest.raises(ValueError, match="tiled order"):
        fp4_linear_xla(x, tiled)
    with pytest.raises(ValueError, match="compiled, of 512"):  # compiled: x's groups in whole lane tiles
        jax.eval_shape(lambda x, r: fp4_matmul_tpu(x, r), x, fp4.tile_k_order(fp4.quantize_mxfp4(w), 256))


@pytest.mark.parametrize("kind", ["mx", "nv"])
def test_tiled_k_order_lowers_for_tpu_at_the_8b_shapes(kind):
    """The tiled kernel lowers to Mosaic at the 8B shape's K's (one tile of 4096; 7 tiles of 2048)
    with no XLA op between x and the kernel but the row pad."""
    from tpuserve.quant.pallas_tpu_matmul import fp4_k_tile

    quantize = fp4.quantize_mxfp4 if kind == "mx" else fp4.quantize_nvfp4
    for k, n in ((4096, 6144), (14336, 4096)):
        tk = fp4_k_tile(k, 32 if kind == "mx" else 16, True)
        rec = jax.eval_shape(
            lambda w, tk=tk: fp4.tile_k_order(quantize(w), tk), jax.ShapeDtypeStruct((k, n), jnp.float32)
        )
        rec = jax.tree.map(lambda a: jax.ShapeDtypeStruct((2, *a.shape), a.dtype), rec)
        fn = jax.jit(lambda x, w, layer: fp4_matmul_tpu(x, w, layer=layer))
        args = (jax.ShapeDtypeStruct((1, k), jnp.bfloat16), rec, jax.ShapeDtypeStruct((), jnp.int32))
        exported = jax.export.export(fn, platforms=["tpu"])(*args)
        assert "tpu_custom_call" in exported.mlir_module()
        ops = {e.primitive.name for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns}
        assert "transpose" not in ops, ops


def test_a_tpu_engine_tiles_mxfp4_records_only():
    """By default a TPU engine re-orders MXFP4 records (faster tiled on a v5e) and leaves NVFP4
    records plain (slower tiled there): ``TILE_RECORDS_FOR_KERNEL``."""
    from tpuserve.quant.pallas_tpu_matmul import tile_records_for_kernel

    _, w = data(8, 1024, 128)
    tree = {"mx": fp4.quantize_mxfp4(w), "nv": fp4.quantize_nvfp4(w), "dense": w}
    out = tile_records_for_kernel(tree)
    assert out["mx"].k_tile == 1024 and out["nv"].k_tile == 0 and out["dense"] is w

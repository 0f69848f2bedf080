"""Sharded weight loading (issue 34): on a mesh over several processes the loader hands out
``device.HostSource`` leaves that read any slice straight from the memory-mapped safetensors
tensors. Here, in one process: every slice of every source equals the same slice of the whole
build (fused qkv and gate_up, stacked layers, transposes, biases, replicated KV heads) bit for bit,
and reading the shards of a split reads each stored byte once. test_multihost.py checks the
hosts of a real two-process engine read about their share.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_weight_load_exact import _write_safetensors  # tests/tpu_platform/test_weight_load_exact.py
from tiny_models import tiny_model  # tests/tpu_platform/tiny_models.py

from tpuserve.tpu_platform.device import HostSource, read_whole
from tpuserve.tpu_platform.loader import safetensors_raw
from tpuserve.tpu_platform.loader.safetensors_raw import SafetensorsFiles
from tpuserve.tpu_platform.models.arch import ModelArch
from tpuserve.tpu_platform.models.sharding import param_partition_specs, replicate_kv_heads
from tpuserve.tpu_platform.models.weights import build_params, unstack_layers


def _checkpoint(tmp_path, kind: str, stored, **kw):
    """A tiny model's safetensors file, with o / MLP biases and attention sinks added (arch
    flags the tiny models leave off), and its reader."""
    arch, tensors, _ = tiny_model(kind, **kw)
    arch = dataclasses.replace(arch, o_bias=True, mlp_bias=True, attention_sinks=True)
    rng = np.random.RandomState(7)
    hid, f, hq = arch.hidden_size, arch.intermediate_size, arch.num_heads
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for name, n in (("self_attn.o_proj.bias", hid), ("mlp.gate_proj.bias", f), ("mlp.up_proj.bias", f)):
            tensors[p + name] = rng.standard_normal(n).astype(np.float32)
        tensors[p + "mlp.down_proj.bias"] = rng.standard_normal(hid).astype(np.float32)
        tensors[p + "self_attn.sinks"] = rng.standard_normal(hq).astype(np.float32)
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, {k: v.astype(stored) for k, v in tensors.items()})
    return (
        arch,
        SafetensorsFiles([str(path)]),
        sum(v.size for v in tensors.values()) * np.dtype(stored).itemsize,
    )


def _random_slices(shape, rng, n: int = 6):
    for _ in range(n):
        index = []
        for size in shape:
            a = int(rng.integers(0, size))
            index.append(slice(a, int(rng.integers(a + 1, size + 1))))
        yield tuple(index)


def _same(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def _check_tree(lazy, whole, rng) -> None:
    lazy_leaves = jax.tree_util.tree_leaves_with_path(lazy)
    whole_leaves = jax.tree_util.tree_leaves_with_path(whole)
    assert [p for p, _ in lazy_leaves] == [p for p, _ in whole_leaves]
    for (path, src), (_, want) in zip(lazy_leaves, whole_leaves, strict=True):
        assert isinstance(src, HostSource), path
        assert src.shape == want.shape and src.dtype == want.dtype, path
        _same(src.whole(), want)
        for index in _random_slices(src.shape, rng):
            _same(src.read(index), np.asarray(want)[index])
        # None bounds, as jax.make_array_from_callback passes a whole axis
        _same(src.read((slice(None),) * src.ndim), want)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("stored", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("target", [jnp.float32, jnp.bfloat16])
def test_every_slice_equals_the_whole_build(tmp_path, kind, stored, target):
    arch, files, _ = _checkpoint(tmp_path, kind, stored)
    whole = build_params(arch, files.get, target)
    lazy = build_params(arch, files.view, target, sharded_reads=safetensors_raw.count)
    rng = np.random.default_rng(0)
    _check_tree(lazy, whole, rng)
    assert lazy["layers"]["sinks"].dtype == np.float32  # kept f32 like the whole build
    # layer_loop="unroll": per-layer sources, each a slice of its stacked one
    _check_tree(unstack_layers(lazy), unstack_layers(whole), rng)
    # what online quantization reads: the whole values, on the device
    for a, b in zip(
        jax.tree_util.tree_leaves(read_whole(lazy)), jax.tree_util.tree_leaves(whole), strict=True
    ):
        _same(a, b)


@pytest.mark.parametrize("tp", [4, 8])
def test_replicated_kv_heads_read_by_slice(tmp_path, tp):
    """KV heads fewer than the TP devices: the grown qkv (and bias) read by slice of the grown
    heads equals the whole build grown."""
    arch, files, _ = _checkpoint(tmp_path, "qwen2", ml_dtypes.bfloat16, heads=8, kv_heads=2)
    whole, arch_w = replicate_kv_heads(build_params(arch, files.get, jnp.float32), arch, tp)
    lazy, arch_l = replicate_kv_heads(
        build_params(arch, files.view, jnp.float32, sharded_reads=safetensors_raw.count), arch, tp
    )
    assert arch_w == arch_l and arch_l.num_kv_heads == tp
    rng = np.random.default_rng(1)
    _check_tree(lazy, whole, rng)
    for name in ("qkv", "qkv_bias"):  # each device's head, as placement asks for it
        src, want = lazy["layers"][name], np.asarray(whole["layers"][name])
        axis = src.ndim - 3
        for j in range(tp):
            index = tuple(slice(j, j + 1) if a == axis else slice(None) for a in range(src.ndim))
            _same(src.read(index), want[index])


def _model_axis_shards(spec, shape, parts: int):
    """The indices of a split of ``shape`` over ``parts`` devices on the "model" axis of
    ``spec`` (one whole index when the spec replicates)."""
    axes = [a for a, s in enumerate(tuple(spec)) if s == "model"]
    if not axes:
        return [tuple(slice(None) for _ in shape)], False
    (axis,) = axes
    step = shape[axis] // parts
    return [
        tuple(slice(k * step, (k + 1) * step) if a == axis else slice(None) for a in range(len(shape)))
        for k in range(parts)
    ], True


def test_shards_read_each_stored_byte_once(tmp_path):
    """Reading every shard of a 2-way split reads the checkpoint's bytes once in all; one shard of
    each split tensor, plus the replicated ones whole (what one of two hosts reads), about half."""
    arch, files, total = _checkpoint(tmp_path, "qwen2", ml_dtypes.bfloat16, heads=8, kv_heads=4)
    read: list[int] = []
    lazy = build_params(arch, files.view, jnp.bfloat16, sharded_reads=read.append)
    assert sum(read) == 0  # nothing read until asked
    specs = param_partition_specs(lazy, "model")
    one_host = 0
    for src, spec in zip(jax.tree_util.tree_leaves(lazy), jax.tree_util.tree_leaves(specs), strict=True):
        shards, split = _model_axis_shards(spec, src.shape, 2)
        for k, index in enumerate(shards):
            before = sum(read)
            src.read(index)
            if k == 0:
                one_host += sum(read) - before
    assert sum(read) == total  # every stored tensor byte, once
    assert 0.45 * total < one_host < 0.55 * total, (one_host, total)


def test_place_reads_a_source_on_one_process_whole(tmp_path):
    """A mesh this process holds entirely: ``place`` reads a source whole, the values of the
    whole build (a multi-process mesh reads slices: test_multihost.py)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpuserve.tpu_platform.device import place

    arch, files, _ = _checkpoint(tmp_path, "llama", ml_dtypes.bfloat16)
    whole = build_params(arch, files.get, jnp.bfloat16)
    lazy = build_params(arch, files.view, jnp.bfloat16, sharded_reads=safetensors_raw.count)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("model",)), P())
    placed = jax.tree_util.tree_map(lambda s: place(s, sharding), lazy)
    for a, b in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(whole), strict=True):
        assert isinstance(a, jax.Array) and a.sharding == sharding
        _same(a, b)


def _moe_checkpoint(tmp_path, gpt_oss: bool, stored, mxfp4: bool = False, sliding: bool = False):
    """A tiny Qwen3-MoE (experts as per-expert tensors, its second layer dense) or gpt-oss (experts
    fused, gate / up in alternating columns, biases and sinks) safetensors file, and its reader.
    ``mxfp4``: gpt-oss's experts as published, random u8 ``*_blocks`` / ``*_scales``."""
    cfg = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32 if mxfp4 else 40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32 if mxfp4 else 24,  # MXFP4 blocks of 32 along each input
        norm_topk_prob=True,
        tie_word_embeddings=False,
        architectures=["GptOssForCausalLM" if gpt_oss else "Qwen3MoeForCausalLM"],
    )
    if not gpt_oss:
        cfg["mlp_only_layers"] = [1]
    if sliding:  # gpt-oss's alternation: layers that attend differently load as a list
        cfg.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    arch = ModelArch.from_hf_config(cfg)
    moe = arch.moe
    assert moe is not None
    rng = np.random.RandomState(3)
    hid, hq, hkv, d = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    e, f = moe.num_experts, moe.expert_intermediate_size

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    t = {"model.embed_tokens.weight": w(64, hid), "model.norm.weight": w(hid), "lm_head.weight": w(64, hid)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        t.update(
            {
                p + "self_attn.q_proj.weight": w(hq * d, hid),
                p + "self_attn.k_proj.weight": w(hkv * d, hid),
                p + "self_attn.v_proj.weight": w(hkv * d, hid),
                p + "self_attn.o_proj.weight": w(hid, hq * d),
                p + "input_layernorm.weight": w(hid),
                p + "post_attention_layernorm.weight": w(hid),
            }
        )
        if arch.qk_norm:
            t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = w(d), w(d)
        if arch.qkv_bias:
            for n, rows in (("q", hq * d), ("k", hkv * d), ("v", hkv * d)):
                t[p + f"self_attn.{n}_proj.bias"] = w(rows)
        if arch.o_bias:
            t[p + "self_attn.o_proj.bias"] = w(hid)
        if arch.attention_sinks:
            t[p + "self_attn.sinks"] = w(hq)
        x = p + "mlp.experts."
        if gpt_oss:
            t.update(
                {
                    p + "mlp.router.weight": w(e, hid),
                    p + "mlp.router.bias": w(e),
                    x + "gate_up_proj": w(e, hid, 2 * f),
                    x + "gate_up_proj_bias": w(e, 2 * f),
                    x + "down_proj": w(e, f, hid),
                    x + "down_proj_bias": w(e, hid),
                }
            )
        elif i in moe.moe_layers:
            t[p + "mlp.gate.weight"] = w(e, hid)
            for j in range(e):
                t[x + f"{j}.gate_proj.weight"] = w(f, hid)
                t[x + f"{j}.up_proj.weight"] = w(f, hid)
                t[x + f"{j}.down_proj.weight"] = w(hid, f)
        else:
            ff = arch.intermediate_size
            t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = w(ff, hid), w(ff, hid)
            t[p + "mlp.down_proj.weight"] = w(hid, ff)
    t = {k: v.astype(stored) for k, v in t.items()}
    if mxfp4:
        for i in range(arch.num_layers):
            x = f"model.layers.{i}.mlp.experts."
            for name, n, k in (("gate_up_proj", 2 * f, hid), ("down_proj", hid, f)):
                del t[x + name]
                t[x + name + "_blocks"] = rng.randint(0, 256, (e, n, k // 32, 16)).astype(np.uint8)
                t[x + name + "_scales"] = rng.randint(118, 130, (e, n, k // 32)).astype(np.uint8)
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, t)
    return arch, SafetensorsFiles([str(path)]), sum(v.nbytes for v in t.values())


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize(
    "stored,target",
    [(ml_dtypes.bfloat16, jnp.bfloat16), (np.float16, jnp.float32), (np.float32, jnp.bfloat16)],
)
def test_moe_every_slice_equals_the_whole_build(tmp_path, gpt_oss, stored, target):
    """Mixture-of-experts checkpoints read by slice too: the experts (per-expert tensors, or
    gpt-oss's fused ones with gate / up de-interleaved), routers and biases equal the whole build."""
    arch, files, _ = _moe_checkpoint(tmp_path, gpt_oss, stored)
    whole = build_params(arch, files.get, target)
    lazy = build_params(arch, files.view, target, sharded_reads=safetensors_raw.count)
    _check_tree(lazy, whole, np.random.default_rng(2))


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_expert_parallel_shards_read_their_experts_only(tmp_path, gpt_oss):
    """Experts split on E over two devices (expert parallel): each device's slice of an expert
    array reads that half of the experts' stored bytes, and the two halves read each byte once."""
    arch, files, _ = _moe_checkpoint(tmp_path, gpt_oss, ml_dtypes.bfloat16)
    read: list[int] = []
    lazy = build_params(arch, files.view, jnp.bfloat16, sharded_reads=read.append)
    layers = lazy["layers"] if isinstance(lazy["layers"], list) else [lazy["layers"]]
    experts = [
        (k, v) for layer in layers for k, v in layer.items() if k in ("experts_gate_up", "experts_down")
    ]
    assert experts
    for key, src in experts:
        e = src.shape[-3]
        stored = int(np.prod(src.shape[-3:])) * 2  # bf16 as stored
        lead = tuple(slice(None) for _ in src.shape[:-3])
        halves = []
        for k in range(2):
            before = sum(read)
            src.read(lead + (slice(k * e // 2, (k + 1) * e // 2),))
            halves.append(sum(read) - before)
        per_layer = stored * (src.shape[0] if lead else 1)
        assert halves == [per_layer // 2, per_layer // 2], (key, halves, per_layer)


@pytest.mark.parametrize("target,sliding", [(jnp.bfloat16, False), (jnp.float32, True)])
def test_gpt_oss_mxfp4_experts_read_by_slice(tmp_path, target, sliding):
    """gpt-oss's published MXFP4 experts (packed records, gate / up columns reordered) read by
    slice: every leaf equals the whole load's record, bytes as stored; a host holding half of the
    experts (expert parallel) reads half of their blocks and scales."""
    from tpuserve.tpu_platform.loader.gpt_oss_mxfp4 import expert_records

    arch, files, _ = _moe_checkpoint(tmp_path, True, ml_dtypes.bfloat16, mxfp4=True, sliding=sliding)
    whole = build_params(arch, files.get, target, expert_records(files.get))
    read: list[int] = []
    lazy = build_params(arch, files.view, target, expert_records(files.view), sharded_reads=read.append)
    _check_tree(lazy, whole, np.random.default_rng(4))
    _check_tree(unstack_layers(lazy), unstack_layers(whole), np.random.default_rng(5))
    # stacked [L, ...] when every layer attends alike, else a list of layers
    assert isinstance(lazy["layers"], list) == sliding
    layers = lazy["layers"][0] if sliding else lazy["layers"]
    lead = () if sliding else (slice(None),)
    assert layers["experts_gate_up"].packed.dtype == np.uint8 == layers["experts_gate_up"].scale.dtype
    for key in ("experts_gate_up", "experts_down"):
        for leaf in (layers[key].packed, layers[key].scale):
            e, stored = leaf.shape[len(lead)], int(np.prod(leaf.shape))
            before = sum(read)
            leaf.read((*lead, slice(0, e // 2)))
            assert sum(read) - before == stored // 2, key


_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _prequantized_checkpoint(tmp_path, fmt: str):
    """A tiny Llama whose seven linears per layer are stored pre-quantized, random codes and
    scales (loading is what is tested, not numerics): ``fp8-block`` (HF ``weight_scale_inv`` per
    8 x 8 block), ``fp8-channel`` (``weight_scale`` [out, 1]), ``nvfp4`` (ModelOpt: u8 ``weight``,
    e4m3 ``weight_scale``, a different ``weight_scale_2`` per tensor) or ``mxfp4``
    (compressed-tensors: ``weight_packed``, e8m0 ``weight_scale``). Returns (arch, reader, its
    CheckpointQuant, the stored bytes)."""
    from tpuserve.tpu_platform.loader.quantized import CheckpointQuant

    arch, tensors, _ = tiny_model("llama", heads=8, kv_heads=4, head_dim=8, ffn=128)
    rng = np.random.RandomState(11)
    for i in range(arch.num_layers):
        for m in _LINEARS:
            name = f"model.layers.{i}.{m}"
            n, k = tensors.pop(name + ".weight").shape
            if fmt.startswith("fp8"):
                tensors[name + ".weight"] = rng.standard_normal((n, k)).astype(ml_dtypes.float8_e4m3fn)
                if fmt == "fp8-block":
                    tensors[name + ".weight_scale_inv"] = rng.uniform(0.5, 2, (-(-n // 8), -(-k // 8)))
                else:
                    tensors[name + ".weight_scale"] = rng.uniform(0.5, 2, (n, 1))
            elif fmt == "nvfp4":
                tensors[name + ".weight"] = rng.randint(0, 256, (n, k // 2)).astype(np.uint8)
                scale = rng.uniform(0.1, 4, (n, k // 16)).astype(ml_dtypes.float8_e4m3fn)
                tensors[name + ".weight_scale"] = scale
                tensors[name + ".weight_scale_2"] = np.asarray(rng.uniform(0.5, 2), np.float32)
            else:
                tensors[name + ".weight_packed"] = rng.randint(0, 256, (n, k // 2)).astype(np.uint8)
                tensors[name + ".weight_scale"] = rng.randint(118, 130, (n, k // 32)).astype(np.uint8)
    tensors = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in tensors.items()}
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, tensors)
    quant = {
        "fp8-block": CheckpointQuant("fp8", "fp8", (8, 8)),
        "fp8-channel": CheckpointQuant("fp8", "fp8"),
        "nvfp4": CheckpointQuant("nvfp4", "modelopt"),
        "mxfp4": CheckpointQuant("mxfp4", "compressed-tensors"),
    }[fmt]
    return arch, SafetensorsFiles([str(path)]), quant, sum(v.nbytes for v in tensors.values())


def _prequantized_builds(tmp_path, fmt: str):
    """(arch, the whole load's params, the per-slice load's (nothing read yet), the list its reads
    are charged to, the stored bytes) of ``_prequantized_checkpoint(fmt)``."""
    from tpuserve.tpu_platform.loader.quantized import read_linear

    arch, files, quant, total = _prequantized_checkpoint(tmp_path, fmt)
    whole = build_params(arch, files.get, jnp.float32, lambda m: read_linear(quant, m, files.get))
    read: list[int] = []
    lazy = build_params(
        arch,
        files.view,
        jnp.float32,
        lambda m: read_linear(quant, m, files.view, lazy=True),
        sharded_reads=read.append,
    )
    return arch, whole, lazy, read, total


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-channel", "nvfp4", "mxfp4"])
def test_prequantized_records_read_by_slice(tmp_path, fmt):
    """A pre-quantized checkpoint's records (fused q|k|v regrouped by KV head, fused gate|up, and
    the single linears) read by slice equal the whole load's records leaf by leaf, bytes as
    stored, stacked and per layer."""
    arch, whole, lazy, read, _ = _prequantized_builds(tmp_path, fmt)
    assert type(lazy["layers"]["qkv"]) is type(whole["layers"]["qkv"])
    assert lazy["layers"]["qkv"].out_shape == whole["layers"]["qkv"].out_shape
    assert sum(read) == 0  # nothing read until asked
    _check_tree(lazy, whole, np.random.default_rng(6))
    _check_tree(unstack_layers(lazy), unstack_layers(whole), np.random.default_rng(7))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8-channel", "fp8-block"])
def test_prequantized_shards_read_their_share(tmp_path, fmt):
    """TP=2 as the engine lays a pre-quantized model out (gate_up's columns grouped by device,
    sharding.group_gate_up_records_by_device) and splits it by the sharding specs: the grouped
    record equals the whole load's grouped the same way; each shard of a split leaf reads exactly
    half of what the whole leaf reads (only its stored rows); all leaves read whole read the
    checkpoint about once (scales widened per column at load aside); one host (a shard of every
    split leaf, the replicated ones whole) about half."""
    from tpuserve.tpu_platform.models.sharding import group_gate_up_records_by_device

    arch, whole, lazy, read, total = _prequantized_builds(tmp_path, fmt)
    lazy, whole = group_gate_up_records_by_device(lazy, 2), group_gate_up_records_by_device(whole, 2)
    assert lazy["layers"]["gate_up"].out_shape == (2, 2, arch.intermediate_size // 2)
    _check_tree(lazy, whole, np.random.default_rng(8))
    read.clear()
    specs = param_partition_specs(lazy, "model")
    everything = one_host = 0
    for src, spec in zip(jax.tree_util.tree_leaves(lazy), jax.tree_util.tree_leaves(specs), strict=True):
        before = sum(read)
        src.whole()
        whole_bytes = sum(read) - before
        everything += whole_bytes
        shards, split = _model_axis_shards(spec, src.shape, 2)
        for k, index in enumerate(shards):
            before = sum(read)
            src.read(index)
            got = sum(read) - before
            assert got == (whole_bytes // 2 if split else whole_bytes), (src, spec)
            one_host += got if k == 0 else 0
    # FP8 8x8 block scales widen 8x per column at load (f32 beside 1-byte codes): ~1.5x
    widened = 1.6 if fmt == "fp8-block" else 1.05
    assert total * 0.99 < everything < total * widened, (everything, total)
    assert 0.45 * everything < one_host < 0.55 * everything, (one_host, everything)

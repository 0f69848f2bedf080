"""gpt-oss's MXFP4 experts kept packed from the checkpoint to the grouped matmul.

The tiny random checkpoints are test_gpt_oss.py's (its ``checkpoints`` fixture: 4 layers, sliding
and full attention alternating, so the layers are a list and run unrolled). The packed path (the
loader's default) is checked against the dequantized one (the loader's ``dequantize_experts``) and
against transformers; its stored bytes against the 4.25 bits a weight MXFP4 costs; the layer scan
with every layer's packed experts stacked; the MoE block through the Pallas kernel in interpret
mode; and the block's lowering for a TPU at gpt-oss-20b's shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_gpt_oss as base  # tests/tpu_platform/test_gpt_oss.py: the checkpoints and oracles
import torch

from tpuserve.quant.fp4 import MXFP4_BLOCK, Mxfp4Weight
from tpuserve.tpu_platform.models.arch import MoeArch

checkpoints = base.checkpoints  # the module-scoped fixture, shared by name


def _load(path: str, **kwargs):
    from tpuserve.tpu_platform.loader import load_model

    return load_model(path, jnp.float32, **kwargs)


def _expert_leaves(params) -> list:
    return [(key, layer[key]) for layer in params["layers"] for key in ("experts_gate_up", "experts_down")]


def test_packed_experts_take_4_25_bits_a_weight(checkpoints):
    """Every expert weight is a record of u8 bytes, 4 bits a code plus 8 bits a 32-block: a
    regression to dense experts (32 bits here, 16 in bf16) fails, and so would a wider layout."""
    loaded = _load(checkpoints["mxfp4"])
    assert loaded.quantization == "mxfp4"
    e, h, f = base.EXPERTS, base.HIDDEN, base.FFN
    weights = stored = 0
    for key, rec in _expert_leaves(loaded.params):
        assert isinstance(rec, Mxfp4Weight), key
        assert all(a.dtype == jnp.uint8 for a in jax.tree_util.tree_leaves(rec))
        k, n = (h, 2 * f) if key == "experts_gate_up" else (f, h)
        assert rec.packed.shape == (e, k // 2, n) and rec.scale.shape == (e, k // MXFP4_BLOCK, n)
        weights += e * k * n
        stored += sum(a.nbytes for a in jax.tree_util.tree_leaves(rec))
    assert stored * 8 / weights == 4.25
    dense = _load(checkpoints["mxfp4"], dequantize_experts=True)
    assert dense.quantization is None
    assert all(hasattr(a, "ndim") and a.dtype == jnp.float32 for _, a in _expert_leaves(dense.params))

    def total(params):
        return sum(a.nbytes for a in jax.tree_util.tree_leaves(params))

    # the whole tree shrinks by exactly the experts' difference: nothing else changed
    assert total(dense.params) - total(loaded.params) == weights * 4 - stored


def test_packed_and_dequantized_experts_give_the_same_logits(checkpoints):
    """Same bytes, decoded in the step (packed) or at load (dequantized): equal to f32 rounding."""
    packed, prompts = base.our_last_logits(checkpoints["mxfp4"])
    dense, _ = base.our_last_logits(checkpoints["mxfp4"], dequantize_experts=True)
    for got, want in zip(packed, dense):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(900)
def test_packed_and_dequantized_experts_give_the_same_greedy_tokens(checkpoints, monkeypatch):
    """Through the offline LLM API (chunked prefill, decode past the window): the engine's default
    (packed) and the loader's dequantized path generate the same tokens."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams
    from tpuserve.tpu_platform import worker

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def generate() -> tuple[list[list[int]], str | None]:
        llm = LLM(
            checkpoints["mxfp4"], max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, warmup=False
        )
        outs = llm.generate(base.PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.worker.quantization

    packed, fmt = generate()
    assert fmt == "mxfp4"
    monkeypatch.setattr(worker, "load_model", functools.partial(worker.load_model, dequantize_experts=True))
    dense, fmt = generate()
    assert fmt is None
    assert packed == dense


@pytest.mark.timeout(600)
def test_scanned_layers_stack_the_packed_experts_and_match_transformers(tmp_path):
    """Every layer full attention: one scanned body, the experts' records stacked [L, E, ...] and
    left out of the scan's slices (decoder._UNSLICED); still transformers' logits."""
    tok = base._tokenizer()
    cfg = base._config(len(tok), tok.eos_token_id)
    cfg.layer_types = ["full_attention"] * base.LAYERS
    dense, mx = str(tmp_path / "dense"), str(tmp_path / "mx")
    base._random_model(cfg).save_pretrained(dense)
    tok.save_pretrained(dense)
    base.write_mxfp4_copy(dense, mx)
    stacked = _load(mx).params["layers"]["experts_down"]
    assert isinstance(stacked, Mxfp4Weight) and stacked.packed.shape[:2] == (base.LAYERS, base.EXPERTS)
    ours, prompts = base.our_last_logits(mx, layers_differ=False)
    hf = base._hf(mx)
    for got, p in zip(ours, prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def _moe_arch(experts: int, top_k: int, ffn: int, layers: int) -> MoeArch:
    return MoeArch.from_gpt_oss_config(
        {"num_local_experts": experts, "num_experts_per_tok": top_k, "intermediate_size": ffn}, layers
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stacked", [False, True], ids=["one_layer", "stacked"])
def test_moe_block_through_the_pallas_kernel_matches_ragged_dot(checkpoints, stacked):
    """The loaded layer's packed experts through the TPU kernel (interpret mode) and through
    XLA's ragged_dot on the dequantized weights give the same MoE output; stacked, the kernel
    reads the layer it is given."""
    from tpuserve.tpu_platform.models.moe import moe_mlp

    layers = _load(checkpoints["mxfp4"]).params["layers"]
    moe = _moe_arch(base.EXPERTS, 2, base.FFN, base.LAYERS)
    x = jax.random.normal(jax.random.PRNGKey(0), (12, base.HIDDEN), jnp.float32)
    which = 2
    w = dict(layers[which])
    layer = None
    if stacked:
        for key in ("experts_gate_up", "experts_down"):
            w[key] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[lw[key] for lw in layers])
        layer = jnp.int32(which)
    got = moe_mlp(x, w, moe, impl="pallas_tpu_interpret", layer=layer)
    want = moe_mlp(x, dict(layers[which]), moe, impl="ragged_dot")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    other = moe_mlp(x, dict(layers[which + 1]), moe, impl="ragged_dot")
    assert not np.allclose(np.asarray(got), np.asarray(other), atol=1e-3)  # the layer matters


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layers", [None, 24], ids=["one_layer", "stacked"])
def test_moe_block_with_packed_experts_lowers_for_tpu_at_gpt_oss_20b_shapes(layers):
    """gpt-oss-20b's MoE block (hidden 2880, 32 experts of 2880, top-4), experts packed, exports for
    TPU from this CPU: both projections are Mosaic kernels reading u8 bytes, no dense expert in
    the program's inputs."""
    from tpuserve.tpu_platform.models.moe import moe_mlp

    t, h, f, e = 16, 2880, 2880, 32
    moe = _moe_arch(e, 4, f, 24)
    lead = (e,) if layers is None else (layers, e)

    def block(x, router, router_bias, gu_packed, gu_scale, gu_bias, d_packed, d_scale, d_bias, *layer):
        w = {
            "router": router,
            "router_bias": router_bias,
            "experts_gate_up": Mxfp4Weight(gu_packed, gu_scale, (2 * f,)),
            "experts_gate_up_bias": gu_bias,
            "experts_down": Mxfp4Weight(d_packed, d_scale, (h,)),
            "experts_down_bias": d_bias,
        }
        return moe_mlp(x, w, moe, impl="pallas_tpu", layer=layer[0] if layer else None)

    def s(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    args = [
        s((t, h)),
        s((h, e)),
        s((e,)),
        s((*lead, h // 2, 2 * f), jnp.uint8),
        s((*lead, h // MXFP4_BLOCK, 2 * f), jnp.uint8),
        s((e, 2 * f)),
        s((*lead, f // 2, h), jnp.uint8),
        s((*lead, f // MXFP4_BLOCK, h), jnp.uint8),
        s((e, h)),
    ]
    if layers is not None:
        args.append(s((), jnp.int32))
    exported = jax.export.export(jax.jit(block), platforms=["tpu"])(*args)
    text = exported.mlir_module()
    assert text.count("tpu_custom_call") >= 2
    assert exported.out_avals[0].shape == (t, h) and exported.out_avals[0].dtype == jnp.bfloat16


def test_partition_specs_keep_the_record_structure(checkpoints):
    """The sharding specs of a packed tree have its structure (a record of specs, replicated), so
    placing the params by them works."""
    from jax.sharding import NamedSharding, PartitionSpec

    from tpuserve.tpu_platform.models.sharding import param_partition_specs

    params = _load(checkpoints["mxfp4"]).params
    specs = param_partition_specs(params)
    rec = specs["layers"][0]["experts_gate_up"]
    assert isinstance(rec, Mxfp4Weight) and rec.packed == PartitionSpec() and rec.scale == PartitionSpec()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    placed = jax.tree.map(lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp)), params, specs)
    assert isinstance(placed["layers"][1]["experts_down"], Mxfp4Weight)


def test_naming_the_checkpoints_own_format_is_not_a_refusal():
    """--quantization mxfp4 on gpt-oss's MXFP4 checkpoint says what it is; on a dense MoE
    checkpoint it would ask for online quantization of experts, which is refused by name."""
    from tpuserve.tpu_platform.config import ConfigError, EngineConfig
    from tpuserve.tpu_platform.models.arch import ModelArch
    from tpuserve.tpu_platform.worker import check_moe_combinations

    arch = ModelArch.from_hf_config({**base._config(32, 0).to_dict(), "architectures": ["GptOssForCausalLM"]})
    config = EngineConfig.from_kwargs(model=None, quantization="mxfp4")
    check_moe_combinations(config, arch, "mxfp4")
    with pytest.raises(ConfigError, match="quantization='mxfp4' with a mixture-of-experts model"):
        check_moe_combinations(config, arch, None)

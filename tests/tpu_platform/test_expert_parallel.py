"""Expert parallelism (``--enable-expert-parallel``): a MoE model's experts split on E over the
tensor-parallel devices, attention tensor parallel as before.

The multi-device checks run in ``ep_child.py`` on 8 fake CPU devices (the device count is fixed
when JAX starts): tiny random Qwen3-MoE and gpt-oss checkpoints (8 experts, top-2; gpt-oss's also
with packed MXFP4 experts) give the logits of one device within f32 noise and the same greedy
tokens at TP=4 (experts replicated) and EP=4 (2 experts a device, checked on the arrays' shards),
with one extra [T, H] all-reduce a layer and no weight gathered. The rest runs on one device: the
split computation itself, and the settings refused by name.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from fake_devices import run_with_devices  # tests/tpu_platform/fake_devices.py

from tpuserve.tpu_platform.config import ConfigError, EngineConfig
from tpuserve.tpu_platform.models.arch import ModelArch
from tpuserve.tpu_platform.models.moe import local_experts, moe_mlp, route
from tpuserve.tpu_platform.models.sharding import param_partition_specs
from tpuserve.tpu_platform.worker import check_moe_combinations

HERE = os.path.dirname(os.path.abspath(__file__))
# Qwen3's tokenizer has 151669 tokens; the vocabulary-parallel embedding needs V divisible by TP.
VOCAB = 151680


def _child(*args: str) -> str:
    return run_with_devices(os.path.join(HERE, "ep_child.py"), *args, devices=8, timeout=1500)


def _qwen3_moe(path: str) -> str:
    """test_qwen3_moe.py's tiny random Qwen3-MoE (8 experts, top-2, 2 layers) at a TP-divisible
    vocabulary."""
    import test_qwen3_moe as base

    return base._build(path, mlp_only_layers=[], norm_topk_prob=True, layers=2, vocab_size=VOCAB)


def _gpt_oss(dense: str, mx: str) -> None:
    """test_gpt_oss.py's tiny random gpt-oss (sinks, biases, clamped SwiGLU, a sliding-window
    layer then a full-attention one), at a TP-divisible vocabulary; and its MXFP4 copy. Two layers,
    not test_gpt_oss.py's four: each layer kind once is what the split is checked on, and every
    8-device program compiles each layer unrolled."""
    import test_gpt_oss as base

    tok = base._tokenizer()
    base._random_model(base._config(VOCAB, tok.eos_token_id, layers=2)).save_pretrained(dense)
    tok.save_pretrained(dense)
    base.write_mxfp4_copy(dense, mx)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_qwen3_moe_expert_parallel_logits_shards_collectives_and_engine(tmp_path):
    path = _qwen3_moe(str(tmp_path / "qwen3-moe"))
    out = _child("runner", "qwen3-moe", path, "unroll", "scan")
    for loop in ("unroll", "scan"):
        assert f"OK qwen3-moe TP=4 {loop}" in out and f"OK qwen3-moe EP=4 {loop}" in out, out
    out = _child("engine", path)
    assert "OK engine greedy EP=4 == TP=4 == one device" in out and "OK weight bytes" in out, out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gpt_oss_expert_parallel_dense_and_mxfp4_experts(tmp_path):
    dense, mx = str(tmp_path / "gptoss"), str(tmp_path / "gptoss-mx")
    _gpt_oss(dense, mx)
    for name, path in (("gpt-oss", dense), ("gpt-oss-mxfp4", mx)):
        out = _child("runner", name, path, "unroll")
        assert f"OK {name} TP=4 unroll" in out and f"OK {name} EP=4 unroll" in out, out


def _moe_arch(gpt_oss: bool) -> ModelArch:
    base = dict(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_local_experts=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
    )
    name = "GptOssForCausalLM" if gpt_oss else "Qwen3MoeForCausalLM"
    return ModelArch.from_hf_config(dict(base, architectures=[name]))


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_local_expert_slices_sum_to_the_whole_block(gpt_oss):
    """What each EP device computes (its E/ep experts, the others masked out), summed over the
    devices, is the one-device expert block; biases (gpt-oss) split with their experts."""
    arch = _moe_arch(gpt_oss)
    moe = arch.moe
    assert moe is not None
    e, h, f = moe.num_experts, arch.hidden_size, moe.expert_intermediate_size
    rng = np.random.RandomState(0)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32)

    w = {"router": arr(h, e), "experts_gate_up": arr(e, h, 2 * f), "experts_down": arr(e, f, h)}
    if gpt_oss:
        w.update(router_bias=arr(e), experts_gate_up_bias=arr(e, 2 * f), experts_down_bias=arr(e, h))
    x = arr(11, h)
    want = np.asarray(moe_mlp(x, w, moe, impl="ragged_dot"))
    weights, experts = route(x, w["router"], moe, w.get("router_bias"))
    for ep in (2, 4, 8):
        n = e // ep
        parts = []
        for d in range(ep):
            local = {k: (v[d * n : (d + 1) * n] if k.startswith("experts_") else v) for k, v in w.items()}
            parts.append(local_experts(x, weights, experts, local, moe, d * n, n, "ragged_dot"))
        np.testing.assert_allclose(np.asarray(sum(parts)), want, rtol=1e-6, atol=1e-6, err_msg=f"ep={ep}")


def test_partition_specs_split_experts_on_e_only_when_asked():
    from jax.sharding import PartitionSpec as P

    from tpuserve.quant.fp4 import Mxfp4Weight

    rec = Mxfp4Weight(
        packed=np.zeros((3, 8, 16, 64), np.uint8), scale=np.zeros((3, 8, 1, 64)), out_shape=(64,)
    )
    layers = {
        "router": np.zeros((3, 32, 8)),
        "experts_gate_up": rec,
        "experts_down": np.zeros((3, 8, 24, 32)),
        "experts_down_bias": np.zeros((3, 8, 32)),
        "o": np.zeros((3, 64, 32)),
    }
    params = {"embed": np.zeros((16, 32)), "layers": layers}
    specs = param_partition_specs(params, "model", expert_parallel=True)["layers"]
    assert specs["experts_gate_up"].packed == P(None, "model") == specs["experts_gate_up"].scale
    assert specs["experts_down"] == P(None, "model") == specs["experts_down_bias"]
    assert specs["router"] == P() and specs["o"] == P(None, "model", None)
    replicated = param_partition_specs(params, "model")["layers"]
    assert replicated["experts_down"] == P() and replicated["experts_gate_up"].packed == P()
    unrolled = param_partition_specs(
        {"embed": params["embed"], "layers": [{"experts_down": np.zeros((8, 24, 32))}]},
        "model",
        expert_parallel=True,
    )
    assert unrolled["layers"][0]["experts_down"] == P("model")


def test_expert_parallel_is_validated_by_name():
    """Refused for a dense model and for an expert count the TP size does not divide; tensor
    parallelism itself is accepted for a MoE model now, with or without the flag."""
    moe = _moe_arch(False)
    dense = ModelArch.from_hf_config(
        dict(
            architectures=["Qwen3ForCausalLM"],
            vocab_size=16,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    ep4 = EngineConfig.from_kwargs(model=None, tensor_parallel_size=4, enable_expert_parallel=True)
    with pytest.raises(ConfigError, match=r"enable_expert_parallel: Qwen3ForCausalLM is a dense model"):
        check_moe_combinations(ep4, dense)
    check_moe_combinations(ep4, moe)
    check_moe_combinations(EngineConfig.from_kwargs(model=None, tensor_parallel_size=4), moe)
    ep3 = EngineConfig.from_kwargs(model=None, tensor_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(
        ConfigError, match=r"the model's 8 experts do not split evenly over tensor_parallel_size=3"
    ):
        check_moe_combinations(ep3, moe)
    with pytest.raises(ConfigError, match="enable_expert_parallel: must be true or false"):
        EngineConfig.from_kwargs(enable_expert_parallel="yes")


def test_cli_flag():
    import argparse

    from tpuserve.server.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "4", "--enable-expert-parallel"])
    config = EngineConfig.from_kwargs(model=None, **engine_kwargs(args))
    assert config.parallel.enable_expert_parallel and config.parallel.tensor_parallel_size == 4
    assert not EngineConfig.from_kwargs(model=None).parallel.enable_expert_parallel

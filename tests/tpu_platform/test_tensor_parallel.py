"""Tensor parallelism over a ("data", "model") mesh of 8 fake CPU devices.

The multi-device checks run in ``tp_child.py`` subprocesses (the device count is fixed when JAX
starts): logits equal to TP=1 within f32 tolerance for TP 2/4/8 on models with 1, 2 and 8 KV heads
(1 and 2 < TP: the replication path), greedy tokens equal, no compile after warm-up, and the
collectives of the compiled step read from its HLO; then the whole engine's greedy output.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from fake_devices import run_with_devices  # tests/tpu_platform/fake_devices.py
from tiny_models import tiny_model  # tests/tpu_platform/tiny_models.py

from tpuserve.tpu_platform.collectives import Collective, collectives, ring_bytes_sent
from tpuserve.tpu_platform.config import ConfigError, EngineConfig
from tpuserve.tpu_platform.mesh import plan_devices
from tpuserve.tpu_platform.models.decoder import compute_logits, forward
from tpuserve.tpu_platform.models.sharding import (
    group_gate_up_by_device,
    kv_head_replicas,
    replicate_kv_heads,
)
from tpuserve.tpu_platform.models.weights import unstack_layers

HERE = os.path.dirname(os.path.abspath(__file__))


def _child(*args: str, devices: int = 8, timeout: float = 600) -> str:
    return run_with_devices(os.path.join(HERE, "tp_child.py"), *args, devices=devices, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp_logits_greedy_warmup_and_collectives():
    out = _child("runner")
    for kv_heads, tps in ((1, (2, 8)), (2, (4,)), (8, (2, 8))):
        for tp in tps:
            assert f"OK logits Hkv={kv_heads} TP={tp} " in out, out
    assert "OK scanned layers TP=4" in out and "OK no compile after warm-up (TP=4)" in out, out
    assert "OK collectives: 5 all-reduces" in out, out
    assert "OK quantized fp8 TP=2" in out and "OK quantized nvfp4 TP=2" in out, out
    assert "OK pallas_tpu_interpret TP=2" in out, out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp_engine_greedy_output_equals_single_device(tmp_path):
    from conftest import build_random_checkpoint

    # Llama-3's tokenizer: V = 128256 splits over 2 and 4; 8 query heads over 2 KV heads.
    path = build_random_checkpoint(
        "llama", str(tmp_path / "llama"), num_attention_heads=8, num_key_value_heads=2
    )
    out = _child("engine", path)
    assert "OK engine greedy TP=2 == TP=1" in out and "OK engine greedy TP=4 == TP=1" in out, out


def test_replicated_kv_heads_and_grouped_gate_up_compute_the_same_model():
    """Single device: the replicated layout (Hkv=2 -> 8 heads) and gate_up grouped by device
    ([H, 2, F] -> [H, TP, 2, F/TP], what quantized TP uses) are the same function."""
    from tiny_models import empty_kv_cache, ragged_step

    arch, _, params = tiny_model("qwen2", layers=2, heads=8, kv_heads=2, ffn=96)  # qkv bias too
    rep_params, rep_arch = replicate_kv_heads(params, arch, 8)
    assert rep_arch.num_kv_heads == 8 and rep_params["layers"]["qkv"].shape[-3:] == (8, 3, 16)
    batch = ragged_step(arch, [5, 3])
    grouped = unstack_layers(group_gate_up_by_device(params, 4))
    assert grouped["layers"][0]["gate_up"].shape == (64, 4, 2, 24)
    outs = []
    for a, p in ((arch, params), (rep_arch, rep_params), (arch, grouped)):
        out = forward(
            p,
            empty_kv_cache(a),
            batch["token_ids"],
            batch["positions"],
            batch["md"],
            arch=a,
            attn_impl="blocked",
            inv_freq=jnp.asarray(a.inv_freq()),
        )
        outs.append(np.asarray(compute_logits(p, out.hidden[batch["logits_indices"]], arch=a)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[2], outs[0], rtol=1e-5, atol=1e-5)


def test_head_split_rules_and_errors():
    assert kv_head_replicas(8, 2, 8) == 4 and kv_head_replicas(8, 8, 2) == 1
    assert kv_head_replicas(32, 8, 8) == 1 and kv_head_replicas(14, 2, 1) == 1
    with pytest.raises(ValueError, match="tensor_parallel_size=4: the model's 6 attention heads"):
        kv_head_replicas(6, 2, 4)
    with pytest.raises(ValueError, match="3 KV heads"):
        kv_head_replicas(12, 3, 2)


def test_config_and_device_errors_name_the_flags():
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 x data_parallel_size=2 needs 8 devices"):
        plan_devices(4, 2, devices=["d0", "d1"])
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be an integer >= 1"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="kv_offloading_size: the host KV tier does not support"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, kv_offloading_size=1.0)
    plan = plan_devices(2, 2, devices=list("abcd"))
    assert plan.rows == (("a", "b"), ("c", "d"))


def test_collectives_parser_and_ring_bytes():
    hlo = """
  %all-reduce.1 = f32[8,64]{1,0} all-reduce(%x), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %ag = bf16[4,128]{0,1} all-gather(%y), dimensions={1}
  %ars = f32[2]{0} all-reduce-start(%z), to_apply=%add
  %not = f32[8,64]{1,0} add(%a, %b)
"""
    ops = collectives(hlo)
    assert ops == [
        Collective("all-reduce", (("f32", (8, 64)),)),
        Collective("all-gather", (("bf16", (4, 128)),)),
        Collective("all-reduce", (("f32", (2,)),)),
    ]
    assert ops[0].shape == (8, 64) and ops[0].nbytes == 8 * 64 * 4 and ops[1].nbytes == 4 * 128 * 2
    assert ring_bytes_sent(ops[0], 4) == 2 * 3 / 4 * ops[0].nbytes
    assert ring_bytes_sent(ops[1], 4) == 3 / 4 * ops[1].nbytes and ring_bytes_sent(ops[0], 1) == 0
    combined = collectives("%ar = (f32[8,64]{1,0}, bf16[8,64]{1,0}) all-reduce(%a, %b), channel_id=1")
    assert combined == [Collective("all-reduce", (("f32", (8, 64)), ("bf16", (8, 64))))]
    assert combined[0].nbytes == 8 * 64 * 6 and combined[0].shape == ((8, 64), (8, 64))

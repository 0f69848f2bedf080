"""Tensor-parallel PartitionSpecs: their shape, and a real 2-device sharded forward on CPU.

The sharded run needs two JAX devices, which XLA_FLAGS can only give before JAX initialises: it runs
this file as a script in a subprocess (``python test_sharding.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fake_devices import run_with_devices  # tests/tpu_platform/fake_devices.py
from jax.sharding import PartitionSpec as P
from tiny_models import empty_kv_cache, ragged_step, tiny_model  # tests/tpu_platform/tiny_models.py

from tpuserve.tpu_platform.models.sharding import kv_cache_partition_spec, param_partition_specs
from tpuserve.tpu_platform.models.weights import unstack_layers


def test_specs_for_stacked_and_unstacked_trees():
    _, _, params = tiny_model("qwen2", layers=2)  # qwen2: qkv bias
    specs = param_partition_specs(params, axis="tp")
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(params)
    assert specs["embed"] == P("tp", None) and specs["lm_head"] == P(None, "tp")
    assert specs["final_norm"] == P()
    lay = specs["layers"]
    assert lay["qkv"] == P(None, None, "tp", None, None)  # [L, H, Hkv, G+2, D]
    assert lay["qkv_bias"] == P(None, "tp", None, None)
    assert lay["o"] == P(None, "tp", None) and lay["down"] == P(None, "tp", None)
    assert lay["gate_up"] == P(None, None, None, "tp")
    assert lay["input_norm"] == P() and lay["post_norm"] == P()

    per = param_partition_specs(unstack_layers(params))["layers"]
    assert len(per) == 2
    assert per[0]["qkv"] == P(None, "model", None, None) and per[1]["gate"] == P(None, "model")
    assert per[1]["up"] == P(None, "model") and "gate_up" not in per[1]  # split for unrolled dots
    assert per[0]["qkv_bias"] == P("model", None, None) and per[0]["o"] == P("model", None)

    flat = dict(params, layers=dict(params["layers"], qkv=params["layers"]["qkv"].reshape(2, 64, -1)))
    with pytest.raises(ValueError, match="'qkv' has rank 3, expected 5"):
        param_partition_specs(flat)


def _step_fn(arch):
    """forward + gather + LM head under one jit, as ModelRunner._traced_forward does it."""
    from tpuserve.tpu_platform.models.decoder import compute_logits, forward

    def step(params, kv, token_ids, positions, md, logits_indices):
        out = forward(
            params,
            kv,
            token_ids,
            positions,
            md,
            arch=arch,
            attn_impl="blocked",
            inv_freq=jnp.asarray(arch.inv_freq()),
            aux_layer_ids=(1,),
        )
        return compute_logits(params, out.hidden[logits_indices], arch=arch), out.aux_hidden, out.kv_cache

    return jax.jit(step)


def _sharded_matches_unsharded():
    """Run in the 2-device subprocess: a prefill then a decode step, sharded vs not, per model."""
    from jax.sharding import Mesh, NamedSharding

    assert jax.device_count() == 2, jax.devices()
    mesh = Mesh(np.asarray(jax.devices()).reshape(1, 2), ("data", "model"))
    for kind, tied, unroll in (("qwen2", False, False), ("llama", True, True), ("qwen3", False, False)):
        # Hkv = 2 heads and F = 96 split evenly over the 2-way "model" axis; so does V = 128.
        arch, _, params = tiny_model(kind, layers=3, heads=4, kv_heads=2, tied=tied)
        if unroll:
            params = unstack_layers(params)
        specs = param_partition_specs(params, "model")
        sharded = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
        assert sharded["embed"].sharding.spec == P("model", None)
        layer0 = sharded["layers"][0] if unroll else sharded["layers"]
        assert len(layer0["qkv"].addressable_shards) == 2
        assert layer0["qkv"].addressable_shards[0].data.shape[-3] == 1  # one KV head per device
        kv_sharding = NamedSharding(mesh, kv_cache_partition_spec("model"))
        step = _step_fn(arch)
        kv_ref, kv_tp = empty_kv_cache(arch), jax.device_put(empty_kv_cache(arch), kv_sharding)
        prefill = ragged_step(arch, [6, 3])
        decode = ragged_step(arch, [1, 1], num_computed=[6, 3], seed=2)
        for batch in (prefill, decode):
            args = (batch["token_ids"], batch["positions"], batch["md"], batch["logits_indices"])
            ref_logits, ref_aux, kv_ref = step(params, kv_ref, *args)
            tp_logits, tp_aux, kv_tp = step(sharded, kv_tp, *args)
            np.testing.assert_allclose(np.asarray(tp_logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(tp_aux[0]), np.asarray(ref_aux[0]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(kv_tp), np.asarray(kv_ref), rtol=1e-5, atol=1e-5)
        # The program really was partitioned: partial sums meet in an all-reduce.
        hlo = step.lower(sharded, kv_tp, *args).compile().as_text()
        assert "all-reduce" in hlo, f"{kind}: no collective in the sharded program"
        print(f"{kind}: sharded logits match", flush=True)


@pytest.mark.timeout(300)
def test_two_device_sharded_forward_matches_unsharded():
    out = run_with_devices(__file__, devices=2, timeout=280)
    assert out.count("sharded logits match") == 3, out


if __name__ == "__main__":
    _sharded_matches_unsharded()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_specs_for_quantized_records(method):
    from tpuserve.tpu_platform.models.quantize import quantize_params

    _, _, params = tiny_model("qwen2", layers=2)
    q, _ = quantize_params(params, method)
    for tree, lead in ((q, (None,)), (unstack_layers(q), ())):
        specs = param_partition_specs(tree, axis="tp")
        # one spec per array, in the record's own structure (what jax.tree.map over both needs)
        assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(tree)
        lay = specs["layers"] if lead else specs["layers"][1]
        data = "qweight" if method == "fp8" else "packed"
        assert getattr(lay["qkv"], data) == P(*lead, None, "tp")  # N: by KV head
        assert getattr(lay["o"], data) == P(*lead, "tp", None)  # K rows: contracted
        assert getattr(lay["down"], data) == P(*lead, "tp", None)
        assert getattr(lay["gate_up"], data) == P()  # [2, F] flattened: replicated
        if method == "fp8":  # per-channel scale [1, N]: one row, split only along N
            assert lay["qkv"].scale == P(*lead, None, "tp") and lay["o"].scale == P()
        else:  # global scale [1, 1]: never split
            assert lay["qkv"].global_scale == P() and lay["o"].scale == P(*lead, "tp", None)

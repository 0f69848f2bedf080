"""The decoder interface: weight layout, hidden states (final and per-layer aux), the LM head."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from tiny_models import empty_kv_cache, ragged_step, tiny_model  # tests/tpu_platform/tiny_models.py

from tpuserve.tpu_platform.loader import load_model
from tpuserve.tpu_platform.models.decoder import DecoderOutput, compute_logits, forward, rms_norm
from tpuserve.tpu_platform.models.weights import unstack_layers


def _run(arch, params, step, kv, aux=()):
    fn = jax.jit(functools.partial(forward, arch=arch, attn_impl="blocked", aux_layer_ids=aux))
    return fn(
        params, kv, step["token_ids"], step["positions"], step["md"], inv_freq=jnp.asarray(arch.inv_freq())
    )


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_weight_layout_groups_heads_by_kv_head(kind):
    arch, t, params = tiny_model(kind, heads=6, kv_heads=2, layers=2)
    g, d, f = 3, arch.head_dim, arch.intermediate_size
    lay = jax.tree.map(np.asarray, params["layers"])
    assert lay["qkv"].shape == (2, arch.hidden_size, 2, g + 2, d)
    assert lay["gate_up"].shape == (2, 2, arch.hidden_size, f)  # [L, gate/up, H, F]
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        q, k, v = (t[p + n + "_proj.weight"] for n in "qkv")
        for kv in range(2):
            for j in range(g):  # query head kv*G + j: HF's GQA order
                h = kv * g + j
                np.testing.assert_array_equal(lay["qkv"][i, :, kv, j], q[h * d : (h + 1) * d].T)
            np.testing.assert_array_equal(lay["qkv"][i, :, kv, g], k[kv * d : (kv + 1) * d].T)
            np.testing.assert_array_equal(lay["qkv"][i, :, kv, g + 1], v[kv * d : (kv + 1) * d].T)
            if arch.qkv_bias:
                bias = lay["qkv_bias"][i, kv]
                np.testing.assert_array_equal(
                    bias[1], t[p + "q_proj.bias"][(kv * g + 1) * d : (kv * g + 2) * d]
                )
                np.testing.assert_array_equal(bias[g + 1], t[p + "v_proj.bias"][kv * d : (kv + 1) * d])
        np.testing.assert_array_equal(lay["gate_up"][i, 0], t[f"model.layers.{i}.mlp.gate_proj.weight"].T)
        np.testing.assert_array_equal(lay["gate_up"][i, 1], t[f"model.layers.{i}.mlp.up_proj.weight"].T)
        np.testing.assert_array_equal(lay["o"][i], t[p + "o_proj.weight"].T)
    # unstack_layers keeps every array, split per layer; gate_up as two arrays (gate, up), so
    # that XLA:CPU's dots read them in place instead of copying a slice of [2, H, F] first
    per = unstack_layers(params)["layers"]
    assert len(per) == 2 and all(per[1][k].shape == lay[k].shape[1:] for k in lay if k != "gate_up")
    assert "gate_up" not in per[1]
    np.testing.assert_array_equal(per[1]["gate"], lay["gate_up"][1, 0])
    np.testing.assert_array_equal(per[1]["up"], lay["gate_up"][1, 1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_hidden_and_aux_hidden_match_transformers(random_checkpoints, loop):
    """aux layer i is the residual entering layer i, i.e. transformers' hidden_states[i] (i < L);
    ``hidden`` is its last, final-normed entry."""
    path = random_checkpoints["qwen2"]
    loaded = load_model(path, jnp.float32)
    arch = loaded.arch
    params = unstack_layers(loaded.params) if loop == "unroll" else loaded.params
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    step = ragged_step(arch, [len(ids)])
    step["token_ids"] = jnp.asarray(ids, jnp.int32)
    nl = arch.num_layers  # 2
    out = _run(arch, params, step, empty_kv_cache(arch), aux=(1, 0, nl, 1))
    assert isinstance(out, DecoderOutput) and len(out.aux_hidden) == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert len(ref) == nl + 1
    tol = dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.hidden), ref[nl][0].numpy(), **tol)
    np.testing.assert_allclose(np.asarray(out.aux_hidden[0]), ref[1][0].numpy(), **tol)
    np.testing.assert_allclose(np.asarray(out.aux_hidden[1]), ref[0][0].numpy(), **tol)
    np.testing.assert_array_equal(np.asarray(out.aux_hidden[1]), np.asarray(params["embed"])[ids])
    np.testing.assert_array_equal(np.asarray(out.aux_hidden[3]), np.asarray(out.aux_hidden[0]))
    # id L: the last layer's output before the final norm
    np.testing.assert_allclose(
        np.asarray(rms_norm(out.aux_hidden[2], params["final_norm"], arch.rms_norm_eps)),
        np.asarray(out.hidden),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_scan_and_unroll_agree_with_and_without_aux(kind):
    arch, _, params = tiny_model(kind, layers=4)
    step = ragged_step(arch, [5, 1, 3])
    plain = _run(arch, params, step, empty_kv_cache(arch))
    assert plain.aux_hidden == () and plain.hidden.shape == (9, arch.hidden_size)
    scan = _run(arch, params, step, empty_kv_cache(arch), aux=(2, 1))  # EAGLE-3 style picks
    unroll = _run(arch, unstack_layers(params), step, empty_kv_cache(arch), aux=(2, 1))
    np.testing.assert_array_equal(np.asarray(scan.hidden), np.asarray(plain.hidden))
    np.testing.assert_array_equal(np.asarray(scan.kv_cache), np.asarray(plain.kv_cache))
    np.testing.assert_allclose(np.asarray(unroll.hidden), np.asarray(scan.hidden), rtol=1e-5, atol=1e-5)
    for a, b in zip(scan.aux_hidden, unroll.aux_hidden):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(scan.aux_hidden[0]), np.asarray(scan.aux_hidden[1]))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        _run(arch, params, step, empty_kv_cache(arch), aux=(arch.num_layers + 1,))


def _consumers(jaxpr, var):
    return [e for e in jaxpr.eqns if any(v is var for v in e.invars)]


def test_scanned_gate_up_slice_feeds_one_batched_dot():
    """In the layer scan, a layer's dense gate_up slice [2, H, F] is read by one dot batched over
    the pair. With two consumers (wgu[0] and wgu[1] as two dots) XLA's TPU compiler copied the whole
    slice every step before the up dot: 89.5 us of the Llama-1B shape's ~216 us layer at batch 1 on
    a v5e (benchmarks/RESULTS.md, 2026-12-06). XLA:CPU does not show the copy, so this checks the
    mechanism: the slice's consumers in the traced scan body."""
    arch, _, params = tiny_model("llama", heads=6, kv_heads=2, layers=2)
    step = ragged_step(arch, [5, 1, 3])
    fn = functools.partial(forward, arch=arch, attn_impl="blocked", inv_freq=jnp.asarray(arch.inv_freq()))
    closed = jax.make_jaxpr(fn)(
        params, empty_kv_cache(arch), step["token_ids"], step["positions"], step["md"]
    )
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    body = scan.params["jaxpr"].jaxpr
    pair = (2, arch.hidden_size, arch.intermediate_size)
    (gate_up,) = [v for v in body.invars if v.aval.shape == pair]
    (use,) = _consumers(body, gate_up)
    assert use.primitive.name == "dot_general"
    (_, (lhs_batch, rhs_batch)) = use.params["dimension_numbers"]
    assert tuple(rhs_batch) == (0,) and tuple(lhs_batch) == (0,)


@pytest.mark.parametrize("tied", [False, True])
def test_compute_logits_is_the_lm_head_in_f32(tied):
    arch, t, params = tiny_model("llama", tied=tied, layers=1)
    assert ("lm_head" in params) != tied
    rows = jnp.asarray(np.random.RandomState(0).standard_normal((3, arch.hidden_size)), jnp.float32)
    logits = jax.jit(functools.partial(compute_logits, arch=arch))(params, rows)
    assert logits.shape == (3, arch.vocab_size) and logits.dtype == jnp.float32
    head = t["model.embed_tokens.weight"] if tied else t["lm_head.weight"]  # HF [V, H]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(rows) @ head.T, rtol=1e-5, atol=1e-5)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    assert compute_logits(bf16, rows.astype(jnp.bfloat16), arch=arch).dtype == jnp.float32

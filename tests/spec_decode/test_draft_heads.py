"""EAGLE-3 and MTP draft heads: the target features they read (against transformers' hidden states),
the published checkpoint layouts, and the paged catch-up / drafting programs against a dense numpy
forward written from the published definitions (EAGLE-3 paper / vLLM's Eagle3 Llama; DeepSeek-V3 MTP).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_random_checkpoint
from draft_checkpoints import with_mtp_layer, write_eagle3
from safetensors.numpy import load_file

from tpuserve.tpu_platform.config import ConfigError, EngineConfig
from tpuserve.tpu_platform.draft_runner import CatchUpSeq
from tpuserve.tpu_platform.loader import load_model
from tpuserve.tpu_platform.loader.draft_head import default_aux_layer_ids, load_draft
from tpuserve.tpu_platform.models.arch import ModelConfigError
from tpuserve.tpu_platform.models.draft_head import to_target_ids
from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq
from tpuserve.tpu_platform.worker import Worker

pytestmark = pytest.mark.timeout(600)

PAGE = 16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    deep = build_random_checkpoint("llama", str(root / "llama8"), num_hidden_layers=8)
    return {
        "target": deep,
        "eagle3": write_eagle3(deep, str(root / "eagle3"), draft_vocab=3000, seed=1),
        "mtp": with_mtp_layer(deep, str(root / "mtp"), seed=2),
    }


def _worker(path, spec):
    config = EngineConfig.from_kwargs(
        model=path,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        block_size=PAGE,
        max_model_len=256,
        num_gpu_blocks=32,
        speculative_config=json.dumps(spec),
    )
    w = Worker(config)
    w.load()
    w.init_kv_cache(32)
    return w


def test_eagle3_features_are_transformers_hidden_states_of_the_default_layers(ckpts):
    """The fc input: the residual streams entering layers (2, L//2, L-3), i.e. transformers'
    output_hidden_states at those indices, concatenated."""
    import torch
    import transformers

    w = _worker(ckpts["target"], {"method": "eagle3", "model": ckpts["eagle3"], "num_speculative_tokens": 2})
    assert w.draft_head.aux_layer_ids == default_aux_layer_ids(8) == (2, 4, 5)
    ids = list(np.random.default_rng(0).integers(100, 5000, 23))
    batch = w.runner.build_batch([ScheduledSeq(ids, 0, [1, 2], SamplingRow())])
    feats = np.asarray(w.runner.forward(batch).features)[: len(ids)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts["target"], torch_dtype=torch.float32)
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = np.concatenate([hs[i][0].numpy() for i in (2, 4, 5)], axis=-1)
    assert feats.shape == (len(ids), 3 * 64)
    np.testing.assert_allclose(feats, want, rtol=2e-4, atol=2e-4)


def test_eagle3_checkpoint_layout_and_d2t(ckpts):
    loaded = load_model(ckpts["target"], jnp.float32)
    head, params = load_draft(
        "eagle3", ckpts["eagle3"], ckpts["target"], loaded.arch, loaded.params, jnp.float32
    )
    raw = load_file(os.path.join(ckpts["eagle3"], "model.safetensors"))
    assert head.draft_vocab_size == 3000 and head.feature_width == 3 * 64
    # d2t holds offsets: draft id i is target id i + d2t[i], the ids t2d marks, in order.
    mapped = np.asarray(to_target_ids(params, jnp.arange(3000)))
    np.testing.assert_array_equal(mapped, np.flatnonzero(raw["t2d"]))
    np.testing.assert_array_equal(np.asarray(params["fc"]), raw["fc.weight"].T)
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), raw["lm_head.weight"].T)
    assert params["embed"] is loaded.params["embed"]  # no embed_tokens: the target's, shared


def test_draft_checkpoints_are_checked(ckpts, tmp_path):
    loaded = load_model(ckpts["target"], jnp.float32)
    args = (loaded.arch, loaded.params, jnp.float32)
    with pytest.raises(ModelConfigError, match="no MTP layers"):
        load_draft("mtp", None, ckpts["target"], *args)
    other = write_eagle3(ckpts["target"], str(tmp_path / "bad"), draft_vocab=100)
    cfg = json.load(open(os.path.join(other, "config.json")))
    json.dump({**cfg, "target_hidden_size": 128}, open(os.path.join(other, "config.json"), "w"))
    with pytest.raises(ModelConfigError, match="hidden size 128"):
        load_draft("eagle3", other, ckpts["target"], *args)
    with pytest.raises(ConfigError, match="eagle3"):
        EngineConfig.from_kwargs(model=ckpts["target"], speculative_config='{"method": "eagle3"}')


# ---- a dense numpy forward of the two heads, from the published definitions ----


def _rms(x, w, eps=1e-6):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def _rope(x, pos, inv_freq):
    f = pos[:, None] * inv_freq[None, :]
    cos, sin = np.cos(f)[:, None, :], np.sin(f)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(t, p, x, pos, heads, kv_heads, inv_freq):
    n = x.shape[0]
    d = t[p + "self_attn.q_proj.weight"].shape[0] // heads
    q = _rope((x @ t[p + "self_attn.q_proj.weight"].T).reshape(n, heads, d), pos, inv_freq)
    k = _rope((x @ t[p + "self_attn.k_proj.weight"].T).reshape(n, kv_heads, d), pos, inv_freq)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).reshape(n, kv_heads, d)
    g = heads // kv_heads
    out = np.zeros((n, heads, d))
    for h in range(heads):
        s = q[:, h] @ k[:, h // g].T / np.sqrt(d)
        s = np.where(pos[None, :] <= pos[:, None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (a / a.sum(-1, keepdims=True)) @ v[:, h // g]
    return out.reshape(n, heads * d) @ t[p + "self_attn.o_proj.weight"].T


def _mlp(t, p, x):
    gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T


def _dense_head(method, t, embed, tokens, hidden, pos, heads, kv_heads, inv_freq, prefix):
    """Pre-norm outputs [N, H] of rows (token q+1, hidden of q, position q); a hidden row of width
    3H is EAGLE-3's target features (through fc), of width H a recycled output."""
    e = embed[tokens]
    if method == "eagle3":
        p = "midlayer."
        h = np.stack([t["fc.weight"] @ r if r.shape[0] != embed.shape[1] else r for r in hidden])
        x = np.concatenate(
            [_rms(e, t[p + "input_layernorm.weight"]), _rms(h, t[p + "hidden_norm.weight"])], -1
        )
        h = h + _attention(t, p, x, pos, heads, kv_heads, inv_freq)
    else:
        p = prefix
        e = np.where((pos == 0)[:, None], 0.0, e)
        hid = np.stack(hidden)
        h = (
            np.concatenate([_rms(e, t[p + "enorm.weight"]), _rms(hid, t[p + "hnorm.weight"])], -1)
            @ t[p + "eh_proj.weight"].T
        )
        h = h + _attention(t, p, _rms(h, t[p + "input_layernorm.weight"]), pos, heads, kv_heads, inv_freq)
    return h + _mlp(t, p, _rms(h, t[p + "post_attention_layernorm.weight"]))


def _dense_next(method, t, out_row, prefix):
    if method == "eagle3":
        logits = t["lm_head.weight"] @ _rms(out_row, t["norm.weight"])
        i = int(np.argmax(logits))
        return i + int(t["d2t"][i])
    return int(
        np.argmax(
            t[prefix + "shared_head.head.weight"] @ _rms(out_row, t[prefix + "shared_head.norm.weight"])
        )
    )


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_paged_catch_up_and_drafting_equal_a_dense_forward(ckpts, method):
    """Two sequences caught up in one batch (features from a real target step) and then drafted
    k = 3 tokens each: same first drafts, recycled states and drafts as the dense forward over
    every row so far."""
    k = 3
    path = ckpts["target"] if method == "eagle3" else ckpts["mtp"]
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "eagle3":
        spec["model"] = ckpts["eagle3"]
    w = _worker(path, spec)
    runner, dr = w.runner, w.draft_runner
    draft_dir = ckpts["eagle3"] if method == "eagle3" else ckpts["mtp"]
    t = {}
    for f in sorted(os.listdir(draft_dir)):
        if f.endswith(".safetensors"):
            t.update(
                {
                    n: a.astype(np.float64) if a.dtype.kind == "f" else a
                    for n, a in load_file(os.path.join(draft_dir, f)).items()
                }
            )
    prefix = "model.layers.8."
    embed = np.asarray(runner.params["embed"], np.float64)
    d_arch = w.draft_head.arch
    inv_freq = d_arch.inv_freq().astype(np.float64)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(100, 5000, n)) for n in (21, 9)]
    pages = [[1, 2], [3]]
    bonus = [777, 4242]
    batch = runner.build_batch([ScheduledSeq(p, 0, pg, SamplingRow()) for p, pg in zip(prompts, pages)])
    fwd = runner.forward(batch)
    feats = np.asarray(fwd.features, np.float64)
    items = [
        CatchUpSeq(0, 0, prompts[0][1:] + [bonus[0]], pages[0]),
        CatchUpSeq(21, 0, prompts[1][1:] + [bonus[1]], pages[1]),
    ]
    seeds = dr.catch_up(fwd.features, items)
    drafts = dr.propose(seeds, [21, 9], pages, k)
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        n, row0 = len(prompt), items[i].row0
        tokens = list(prompt[1:]) + [bonus[i]]
        hidden = [feats[row0 + j] for j in range(n)]
        want = []
        for j in range(k):
            out = _dense_head(
                method,
                t,
                embed,
                np.asarray(tokens),
                hidden,
                np.arange(len(tokens), dtype=np.float64),
                d_arch.num_heads,
                d_arch.num_kv_heads,
                inv_freq,
                prefix,
            )
            want.append(_dense_next(method, t, out[-1], prefix))
            if j == 0:
                assert seed.first_token == want[0]
                np.testing.assert_allclose(seed.hidden, out[-1], rtol=1e-3, atol=1e-3)
            tokens.append(want[-1])
            hidden.append(out[-1])
        assert [int(x) for x in drafts[i]] == want, (method, i)

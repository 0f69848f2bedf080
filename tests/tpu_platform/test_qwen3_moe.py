"""Qwen3-MoE served through the decoder, checked against transformers' own Qwen3MoeForCausalLM.

transformers builds tiny random checkpoints (f32, published tensor names) with a real tokenizer;
the same weights are the oracle. Two structures: experts in every layer (layers scanned as one
stack) and a dense MLP in one layer via ``mlp_only_layers`` (layers run unrolled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_oracle import hf_greedy
from runner_fixtures import assert_layer_scan_takes_whole, scan_runner

from tpuserve.tpu_platform.config import ConfigError
from tpuserve.tpu_platform.models.arch import ModelArch, ModelConfigError
from tpuserve.tpu_platform.models.moe import grouped_matmul, moe_mlp

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "In 2024, 17 researchers published 3 papers on paged attention for TPUs and GPUs alike.",
]


def _build(
    path: str, *, mlp_only_layers: list[int], norm_topk_prob: bool, layers: int, vocab_size: int | None = None
) -> str:
    """A tiny random Qwen3-MoE (8 experts, top-2) with Qwen3's tokenizer; ``vocab_size`` pads the
    vocabulary (a TP-divisible one for the sharding tests)."""
    from conftest import real_tokenizer

    tok = real_tokenizer("qwen3")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size or len(tok),
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=mlp_only_layers,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.float32).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"mixed": experts in layers 0 and 2, a dense MLP in layer 1; "sparse": experts everywhere}."""
    return {
        "mixed": _build(
            str(tmp_path_factory.mktemp("qmoe-mixed")), mlp_only_layers=[1], norm_topk_prob=True, layers=3
        ),
        "sparse": _build(
            str(tmp_path_factory.mktemp("qmoe-sparse")), mlp_only_layers=[], norm_topk_prob=False, layers=2
        ),
    }


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_grouped_matmul_is_a_matmul_per_group():
    """The contract a replacement kernel must keep, empty groups included."""
    rng = np.random.RandomState(0)
    sizes = np.array([3, 0, 5, 1, 0, 7], np.int32)
    lhs = rng.standard_normal((sizes.sum(), 8)).astype(np.float32)
    rhs = rng.standard_normal((len(sizes), 8, 4)).astype(np.float32)
    got = np.asarray(grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes)))
    group = np.repeat(np.arange(len(sizes)), sizes)
    want = np.einsum("mk,mkn->mn", lhs, rhs[group])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_padding_rows_stay_finite():
    """Zero rows (what padding slots may hold) route somewhere and give finite outputs."""
    arch = ModelArch.from_hf_config(
        dict(
            architectures=["Qwen3MoeForCausalLM"],
            vocab_size=16,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=4,
            norm_topk_prob=True,
        )
    )
    rng = np.random.RandomState(1)
    w = {
        "router": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
        "experts_gate_up": jnp.asarray(rng.standard_normal((4, 8, 8)), jnp.float32),
        "experts_down": jnp.asarray(rng.standard_normal((4, 4, 8)), jnp.float32),
    }
    x = jnp.concatenate([jnp.asarray(rng.standard_normal((3, 8)), jnp.float32), jnp.zeros((5, 8))])
    y = jax.jit(lambda x: moe_mlp(x, w, arch.moe))(x)
    assert y.shape == (8, 8) and bool(jnp.isfinite(y).all())


@pytest.mark.parametrize(
    "arch_name",
    ["Qwen2MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM", "Qwen3NextForCausalLM"],
)
def test_unsupported_moe_architectures_are_refused_by_name(arch_name):
    cfg = dict(
        architectures=[arch_name],
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    with pytest.raises(ModelConfigError, match=f"{arch_name} is not supported"):
        ModelArch.from_hf_config(cfg)


def test_config_fields(checkpoints):
    import json
    import os

    with open(os.path.join(checkpoints["mixed"], "config.json")) as f:
        moe = ModelArch.from_hf_config(json.load(f)).moe
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (8, 2, 32)
    assert moe.norm_topk_prob and moe.moe_layers == (0, 2)
    cfg = dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=4,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    moe = ModelArch.from_hf_config(cfg).moe
    assert moe is not None and moe.moe_layers == (1, 5)  # every 2nd layer (1-based), 3 listed dense


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["mixed", "sparse"])
def test_last_position_logits_match_transformers(checkpoints, kind):
    from tpuserve.tpu_platform.loader import load_model
    from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

    path = checkpoints[kind]
    loaded = load_model(path, jnp.float32)
    assert isinstance(loaded.params["layers"], list if kind == "mixed" else dict)
    runner = scan_runner(path, loaded)
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    seqs, next_page = [], 1
    for p in prompts:  # one ragged step over all prompts
        n = -(-len(p) // runner.page_size)
        seqs.append(ScheduledSeq(p, 0, list(range(next_page, next_page + n)), SamplingRow()))
        next_page += n
    assert isinstance(runner.params["layers"], dict if kind == "sparse" else list)
    assert runner.layer_loop == ("scan" if kind == "sparse" else "unroll")
    ours = runner.compute_logits(runner.build_batch(seqs))
    hf = _hf(path)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(ours[i], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(900)
def test_greedy_generation_matches_transformers_batched_and_alone(checkpoints):
    """Greedy tokens through the offline LLM API equal transformers'; the ragged batch of all
    prompts (small token budget: chunked prefill beside decodes) equals each prompt alone."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    path = checkpoints["mixed"]
    llm = LLM(path, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batched = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
    hf = _hf(path)
    tok = llm.get_tokenizer()
    for prompt, b, a in zip(PROMPTS, batched, alone):
        want = hf_greedy(hf, tok.encode(prompt), 12)
        assert b.outputs[0].token_ids == want
        assert a.outputs[0].token_ids == want


@pytest.mark.timeout(900)
def test_ngram_speculative_decoding_keeps_greedy_tokens(checkpoints):
    """n-gram drafts are verified by a multi-token forward per sequence through the experts; the
    greedy tokens stay transformers'."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    path = checkpoints["mixed"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(
        path,
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        speculative_config=spec,
        warmup=False,
    )
    rng = np.random.default_rng(0)
    prompts = []
    for n in (5, 7):  # repeated motifs: the n-gram drafter finds matches
        motif = [int(t) for t in rng.integers(100, 3000, n)]
        prompts.append(motif * 3 + motif[:2])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.stats.spec_num_draft_tokens > 0
    hf = _hf(path)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 12)


def test_quantization_with_moe_is_refused(checkpoints):
    from tpuserve.server.llm import LLM

    with pytest.raises(ConfigError, match="quantization='fp8' with a mixture-of-experts model"):
        LLM(checkpoints["sparse"], max_model_len=64, quantization="fp8", warmup=False)


def test_prequantized_moe_checkpoint_is_refused(checkpoints, tmp_path):
    """A quantization_config on a MoE checkpoint: its experts would be read without their scales."""
    import json
    import os
    import shutil

    from tpuserve.tpu_platform.loader import load_model

    path = shutil.copytree(checkpoints["sparse"], tmp_path / "fp8")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelConfigError, match=r"pre-quantized \(fp8\) mixture-of-experts"):
        load_model(str(path), jnp.float32)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(data_parallel_size=2), "data_parallel_size=2"),
        (dict(quantization="nvfp4"), "quantization='nvfp4'"),
        (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}), "method='mtp'"),
    ],
)
def test_unsupported_combinations_are_named(kwargs, named):
    """Each setting the MoE path does not handle fails with its own name; a dense model passes."""
    from tpuserve.tpu_platform.config import EngineConfig
    from tpuserve.tpu_platform.worker import check_moe_combinations

    base = dict(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=4,
    )
    config = EngineConfig.from_kwargs(model=None, **kwargs)
    with pytest.raises(ConfigError, match=f"{named} with a mixture-of-experts model"):
        check_moe_combinations(
            config, ModelArch.from_hf_config(dict(base, architectures=["Qwen3MoeForCausalLM"]))
        )
    check_moe_combinations(config, ModelArch.from_hf_config(dict(base, architectures=["Qwen3ForCausalLM"])))


@pytest.mark.timeout(900)
def test_memory_plan_and_warmup_then_serve(checkpoints):
    """The engine sizes its KV cache and compiles every step shape up front (warm-up on) for a MoE
    model, then serves a request with the same tokens as transformers without compiling more."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    path = checkpoints["mixed"]
    llm = LLM(path, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2)
    runner = llm.engine.runner
    # what an accelerator's memory plan measures: the widest step's compiled temporaries
    assert runner.step_memory()["forward"] > 0
    before = runner.compile_count
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert runner.compile_count == before, "serving compiled a program warm-up did not"
    tok = llm.get_tokenizer()
    assert out.outputs[0].token_ids == hf_greedy(_hf(path), tok.encode(PROMPTS[0]), 8)


@pytest.mark.timeout(300)
def test_expert_block_on_the_pallas_kernel_equals_ragged_dot():
    """The expert block through the grouped-matmul kernel (what a TPU runs, here interpreted)
    equals it through XLA's ragged_dot, tokens routed unevenly over the experts."""
    arch = ModelArch.from_hf_config(
        dict(
            architectures=["Qwen3MoeForCausalLM"],
            vocab_size=16,
            hidden_size=128,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
        )
    )
    rng = np.random.RandomState(3)
    w = {
        "router": jnp.asarray(rng.standard_normal((128, 8)), jnp.float32),
        "experts_gate_up": jnp.asarray(rng.standard_normal((8, 128, 128)) * 0.1, jnp.float32),
        "experts_down": jnp.asarray(rng.standard_normal((8, 64, 128)) * 0.1, jnp.float32),
    }
    x = jnp.asarray(rng.standard_normal((24, 128)), jnp.float32)
    want = moe_mlp(x, w, arch.moe, impl="ragged_dot")
    got = moe_mlp(x, w, arch.moe, impl="pallas_tpu_interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.timeout(300)
def test_layer_scan_passes_the_expert_stacks_whole(checkpoints):
    """The scanned step hands the expert stacks [L, E, ...] to the scan as constants, not as
    per-layer slices: on a TPU a slice feeding the grouped-matmul kernel is materialized, a copy
    of every expert of the layer each step. Fails if the decoder scans over them again."""
    from tpuserve.tpu_platform.loader import load_model

    path = checkpoints["sparse"]
    loaded = load_model(path, jnp.float32)
    runner = scan_runner(path, loaded)
    layers = runner.params["layers"]
    stacks = {tuple(layers[k].shape) for k in ("experts_gate_up", "experts_down")}
    assert_layer_scan_takes_whole(runner, stacks, "expert stacks")

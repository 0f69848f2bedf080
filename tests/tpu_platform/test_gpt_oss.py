"""gpt-oss served through the decoder, checked against transformers' own GptOssForCausalLM.

transformers builds a tiny random checkpoint (f32, published tensor names, a real tokenizer):
4 layers alternating sliding-window (4 tokens, so every prompt here outgrows it) and full
attention, YaRN rope, attention sinks, 8 experts top-2 with biases and the clamped SwiGLU. The
random weights are scaled so that what could be wrong shows: the sinks, router bias and expert
biases are far from zero, and the gate/up activations often pass the clamp limit (a test below
checks that transformers' own logits move when the limit does). The MXFP4 variant writes the
experts as the published ``*_blocks`` / ``*_scales``; its oracle is transformers loading that same
checkpoint (on CPU, without Triton, transformers 5.23 dequantizes the experts at load, to f32 here),
and the decode itself is checked bit for bit against transformers' ``convert_moe_packed_tensors``.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_oracle import hf_greedy
from runner_fixtures import scan_runner

from tpuserve.tpu_platform.models.arch import ModelArch

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "In 2024, 17 researchers published 3 papers on paged attention for TPUs and GPUs alike.",
]
LAYERS = 4
EXPERTS, FFN, HIDDEN = 8, 64, 64


def _config(vocab: int, eos: int, layers: int = LAYERS) -> transformers.GptOssConfig:
    """layers: even (sliding-window and full attention alternate)."""
    return transformers.GptOssConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=eos,
    )


def _random_model(cfg) -> transformers.GptOssForCausalLM:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.router.bias.normal_(0.0, 0.5)
            ex = layer.mlp.experts
            ex.gate_up_proj.normal_(0.0, 0.6)  # normed inputs: gate/up std ~5, the clamp at 7 bites
            ex.gate_up_proj_bias.normal_(0.0, 0.5)
            ex.down_proj.normal_(0.0, 0.05)
            ex.down_proj_bias.normal_(0.0, 0.1)
    return model


def _encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense [E, in, out] -> the published (blocks u8 [E, out, in/32, 16], scales u8 [E, out, in/32]).

    Round to nearest e2m1 under the block's power-of-two scale (OCP's choice of exponent). The
    even element of each pair goes in the low nibble, as gpt-oss's checkpoints pack them."""
    e, k, n = w.shape
    x = np.swapaxes(w, 1, 2).reshape(e, n, k // 32, 32).astype(np.float64)
    amax = np.maximum(np.abs(x).max(-1, keepdims=True), 2.0**-100)
    exp = np.floor(np.log2(amax)) - 2  # e2m1's largest exponent is 2 (6 = 1.5 * 2**2)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    mag = np.abs(x) / 2.0**exp
    code = np.abs(mag[..., None] - grid).argmin(-1) + 8 * (x < 0)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    scales = (exp[..., 0] + 127).astype(np.uint8)
    # contiguous: safetensors' numpy writer takes an array's buffer as it lies in memory
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)


def _tokenizer():
    from conftest import real_tokenizer

    return real_tokenizer("qwen3")


MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def write_mxfp4_copy(dense: str, mx: str, oracle: str | None = None) -> None:
    """``mx``: the dense checkpoint at ``dense`` with its experts as published blocks/scales (the
    rest f32). ``oracle`` (optional): the dense tensors transformers' ``convert_moe_packed_tensors``
    decodes from those bytes, for the bit-exact decode check."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    (st,) = [f for f in os.listdir(dense) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(dense, st))
    with open(os.path.join(dense, "config.json")) as f:
        config = json.load(f)
    packed, decoded = dict(tensors), dict(tensors)
    for i in range(config["num_hidden_layers"]):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = _encode_mxfp4(packed.pop(key))
            packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
            decoded[key] = convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
            ).numpy()
    tok = _tokenizer()
    os.makedirs(mx, exist_ok=True)
    save_file(packed, os.path.join(mx, st), metadata={"format": "pt"})
    with open(os.path.join(mx, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": MXFP4_QUANTIZATION_CONFIG}, f)
    tok.save_pretrained(mx)
    if oracle is not None:
        os.makedirs(oracle, exist_ok=True)
        save_file(decoded, os.path.join(oracle, st), metadata={"format": "pt"})
        with open(os.path.join(oracle, "config.json"), "w") as f:
            json.dump(config, f)
        tok.save_pretrained(oracle)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"dense": f32 experts; "mxfp4": the experts as published blocks/scales, the rest f32;
    "mxfp4_oracle": the dense tensors transformers' ``convert_moe_packed_tensors`` decodes from
    those bytes (for the bit-exact decode check)}."""
    tok = _tokenizer()
    cfg = _config(len(tok), tok.eos_token_id)
    dense = str(tmp_path_factory.mktemp("gptoss-dense"))
    model = _random_model(cfg)
    model.save_pretrained(dense)
    tok.save_pretrained(dense)
    mx, oracle = str(tmp_path_factory.mktemp("gptoss-mxfp4")), str(tmp_path_factory.mktemp("gptoss-mx-o"))
    write_mxfp4_copy(dense, mx, oracle)
    return {"dense": dense, "mxfp4": mx, "mxfp4_oracle": oracle}


def _hf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # an MXFP4 checkpoint too: its experts dequantized at load, in f32 (not the bf16 it warns of)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    return model


def test_config_fields(checkpoints):
    with open(os.path.join(checkpoints["dense"], "config.json")) as f:
        arch = ModelArch.from_hf_config(json.load(f))
    assert arch.layer_sliding_windows == (4, None, 4, None) and arch.sliding_window is None
    assert arch.attention_sinks and arch.qkv_bias and arch.o_bias
    moe = arch.moe
    assert moe is not None and moe.moe_layers == (0, 1, 2, 3)
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (EXPERTS, 2, FFN)
    assert moe.softmax_after_topk and moe.router_bias and moe.expert_bias
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (1.702, 7.0)
    assert arch.rope_attention_factor() > 1.0  # YaRN's temperature, factor 8


def test_yarn_rope_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    tok_vocab = 32
    for truncate in (False, True):
        cfg = _config(tok_vocab, 0)
        cfg.rope_parameters = {**cfg.rope_parameters, "truncate": truncate}
        arch = ModelArch.from_hf_config({**cfg.to_dict(), "architectures": ["GptOssForCausalLM"]})
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
        np.testing.assert_allclose(arch.inv_freq(), inv.numpy(), rtol=1e-6, atol=0)
        assert arch.rope_attention_factor() == pytest.approx(factor, rel=1e-12)


def test_this_checkpoint_exercises_the_clamp_and_the_window(checkpoints):
    """So a missing clamp or a missing window would fail the comparisons below: transformers' own
    logits move when either is removed."""
    hf = _hf(checkpoints["dense"])
    ids = torch.tensor([_tokenizer().encode(PROMPTS[2])])
    with torch.no_grad():
        base = hf(ids).logits[0, -1].numpy()
        for layer in hf.model.layers:
            layer.mlp.experts.limit = 1e9
        no_clamp = hf(ids).logits[0, -1].numpy()
    assert np.abs(base - no_clamp).max() > 1e-2
    hf = _hf(checkpoints["dense"])
    hf.config.layer_types = ["full_attention"] * LAYERS
    with torch.no_grad():
        no_window = hf(ids).logits[0, -1].numpy()
    assert np.abs(base - no_window).max() > 1e-2


def our_last_logits(
    path: str, layers_differ: bool = True, dequantize_experts: bool = False
) -> tuple[list[np.ndarray], list[list[int]]]:
    """One ragged step over all prompts through the runner (asked to scan its layers): each
    prompt's last-position logits."""
    from tpuserve.tpu_platform.loader import load_model
    from tpuserve.tpu_platform.step_batch import SamplingRow, ScheduledSeq

    loaded = load_model(path, jnp.float32, dequantize_experts=dequantize_experts)
    # sliding and full layers cannot share a scanned body: the loader hands them over as a list
    assert isinstance(loaded.params["layers"], list if layers_differ else dict)
    runner = scan_runner(path, loaded)
    assert runner.layer_loop == ("unroll" if layers_differ else "scan")
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    seqs, next_page = [], 1
    for p in prompts:
        n = -(-len(p) // runner.page_size)
        seqs.append(ScheduledSeq(p, 0, list(range(next_page, next_page + n)), SamplingRow()))
        next_page += n
    ours = runner.compute_logits(runner.build_batch(seqs))
    return [np.asarray(ours[i]) for i in range(len(prompts))], prompts


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, oracle", [("dense", "dense"), ("mxfp4", "mxfp4")])
def test_last_position_logits_match_transformers(checkpoints, kind, oracle):
    ours, prompts = our_last_logits(checkpoints[kind])
    assert max(len(p) for p in prompts) > 4 * 4  # several windows long
    hf = _hf(checkpoints[oracle])
    for got, p in zip(ours, prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_mxfp4_experts_decode_to_transformers_weights(checkpoints):
    """The loader's decode of the published blocks/scales equals transformers', bit for bit (a
    swapped nibble order or a transposed [out, in] would not)."""
    from safetensors.numpy import load_file

    from tpuserve.tpu_platform.loader.gpt_oss_mxfp4 import decode_expert

    def tensors(path):
        (st,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        return load_file(os.path.join(path, st))

    packed, want = tensors(checkpoints["mxfp4"]), tensors(checkpoints["mxfp4_oracle"])
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{name}"
        got = decode_expert(packed[key + "_blocks"], packed[key + "_scales"])
        assert np.array_equal(got.view(np.uint32), want[key].view(np.uint32))
    dense = tensors(checkpoints["dense"])["model.layers.1.mlp.experts.down_proj"]
    assert not np.array_equal(dense, want["model.layers.1.mlp.experts.down_proj"])  # really rounded


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind, oracle", [("dense", "dense"), ("mxfp4", "mxfp4")])
def test_greedy_generation_matches_transformers(checkpoints, kind, oracle):
    """Greedy tokens through the offline LLM API equal transformers' (prompts and outputs run
    well past the 4-token window; a small token budget chunks the prefill)."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = LLM(checkpoints[kind], max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    hf = _hf(checkpoints[oracle])
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, tok.encode(prompt), 10)


def test_published_20b_config_parses():
    """The fields of openai/gpt-oss-20b's config.json (old-style ``rope_scaling``, MXFP4 config)."""
    cfg = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "rope_theta": 150000,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn"],
        },
    }
    arch = ModelArch.from_hf_config(cfg)
    assert arch.layer_window(0) == 128 and arch.layer_window(1) is None
    assert arch.moe is not None and (arch.moe.num_experts, arch.moe.top_k) == (32, 4)
    assert arch.moe.swiglu_alpha == 1.702 and arch.rope_theta == 150000.0
    assert arch.rope_attention_factor() == pytest.approx(0.1 * np.log(32.0) + 1.0)
    from tpuserve.tpu_platform.loader.gpt_oss_mxfp4 import is_gpt_oss_mxfp4

    assert is_gpt_oss_mxfp4(cfg)


@pytest.mark.timeout(600)
def test_ngram_speculative_decoding_and_prefix_cache_keep_greedy_tokens(checkpoints):
    """n-gram drafts verified by multi-token forwards through the sliding layers, and a second
    round served from cached prefix pages, both give transformers' greedy tokens."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = LLM(
        checkpoints["dense"],
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=2,
        warmup=False,
        enable_prefix_caching=True,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )
    rng = np.random.default_rng(0)
    prompts = []
    for n in (5, 7):  # repeated motifs, longer than the window: the n-gram drafter finds matches
        motif = [int(t) for t in rng.integers(100, 3000, n)]
        prompts.append(motif * 3 + motif[:2])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    first = llm.generate(reqs, params, use_tqdm=False)
    assert llm.engine.stats.spec_num_draft_tokens > 0
    hits = llm.engine.stats.prefix_cache_hits
    again = llm.generate(reqs, params, use_tqdm=False)
    assert llm.engine.stats.prefix_cache_hits > hits  # the second round read cached pages
    hf = _hf(checkpoints["dense"])
    for p, a, b in zip(prompts, first, again):
        want = hf_greedy(hf, p, 10)
        assert a.outputs[0].token_ids == want and b.outputs[0].token_ids == want


@pytest.mark.timeout(600)
def test_host_tier_brings_back_evicted_pages_across_the_sliding_layers(checkpoints):
    """Prompts sharing a long prefix, pushed out of a 9-page device pool by others and sent again:
    the prefix pages come back from the host tier (every layer's slice of a page, the 4-token
    sliding layers' as well as the full ones') and the greedy tokens are those of an engine
    without any cache, with the n-gram drafter on."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    engine = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2, block_size=16, warmup=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    rng = np.random.default_rng(1)
    prefix = [int(t) for t in rng.integers(100, 3000, 64)]  # 4 full pages
    motif = [int(t) for t in rng.integers(100, 3000, 5)]
    # 80 tokens: 64 come from the cache, and the first computed position's 4-token window reads the
    # last 3 tokens of reloaded page 3 in the sliding layers. The repeats give the drafter matches.
    shared = [prefix + motif * 3 + [int(t)] for t in (7, 11)]
    flood = [[int(t) for t in rng.integers(100, 3000, 100)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rounds = [shared, flood, shared]  # one request at a time, so each round sees the one before

    def run(llm):
        return [
            o.outputs[0].token_ids
            for prompts in rounds
            for p in prompts
            for o in llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        ]

    want = run(LLM(checkpoints["dense"], enable_prefix_caching=False, num_gpu_blocks=64, **engine))
    # 8 usable pages: one 100-token flood prompt takes 7, so the shared prefix leaves the device.
    llm = LLM(
        checkpoints["dense"],
        num_gpu_blocks=9,
        kv_offloading_size=64 * 16 * LAYERS * 4 * 16 * 4 / 2**30,  # 64 pages: [L, 16, 2x2 heads, 16] f32
        speculative_config=spec,
        **engine,
    )
    e = llm.engine
    assert run(llm) == want
    assert e.host_tier.num_slots == 64
    # The first shared prompt of the last round reloads the 4 prefix pages (the second then finds
    # them on the device).
    assert e.stats.host_cache_hits >= 64 and e.host_tier.stats.loaded_pages >= 4, (
        e.stats.host_cache_hits,
        e.host_tier.stats,
    )
    assert e.stats.spec_num_draft_tokens > 0
    assert e.pool.num_free == e.pool.num_usable


@pytest.mark.timeout(600)
def test_full_attention_only_layers_run_scanned_and_match_transformers(tmp_path):
    """With every layer full attention the layers share one body: stacked and scanned (sinks and
    expert biases through ``lax.scan``), still transformers' logits."""
    tok = _tokenizer()
    cfg = _config(len(tok), tok.eos_token_id)
    cfg.layer_types = ["full_attention"] * LAYERS
    _random_model(cfg).save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    ours, prompts = our_last_logits(str(tmp_path), layers_differ=False)
    hf = _hf(str(tmp_path))
    for got, p in zip(ours, prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(data_parallel_size=2), "data_parallel_size=2"),
        (dict(quantization="mxfp4"), "quantization='mxfp4'"),
    ],
)
def test_unsupported_combinations_are_named(kwargs, named):
    """gpt-oss takes the MoE path's refusals (tensor and expert parallel are supported:
    test_expert_parallel.py)."""
    from tpuserve.tpu_platform.config import ConfigError, EngineConfig
    from tpuserve.tpu_platform.worker import check_moe_combinations

    arch = ModelArch.from_hf_config({**_config(32, 0).to_dict(), "architectures": ["GptOssForCausalLM"]})
    with pytest.raises(ConfigError, match=f"{named} with a mixture-of-experts model"):
        check_moe_combinations(EngineConfig.from_kwargs(model=None, **kwargs), arch)

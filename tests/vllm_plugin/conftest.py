"""Fixtures for the vLLM plugin tests.

Most tests here need vLLM and run only in the vLLM venv (``"$(bash scripts/vllm_env.sh)" -m pytest
tests/vllm_plugin``); in the main venv they skip, and test_vllm_venv_suite.py runs them over there.
"""

from __future__ import annotations

import pytest
from vllm_helpers import root_conftest


@pytest.fixture(scope="session")
def default_hf_dir() -> str:
    """The default model (SmolLM2-135M-Instruct) exported as a Hugging Face directory."""
    from tpuserve.tpu_platform.loader.export import default_model_hf_dir

    return default_model_hf_dir()


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> str:
    """A random-weight Qwen3 with the real Qwen3 tokenizer (tests/conftest.py)."""
    return root_conftest().build_random_checkpoint("qwen3", str(tmp_path_factory.mktemp("vllm-qwen3")))

"""``vllm serve --device tpu --tensor-parallel-size 2``: one worker, a 2-device JAX mesh.

JAX's CPU backend gets two fake devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2``,
set in the server's environment so the engine core's JAX sees it when it starts). The model is the
random-weight Qwen3 (4 attention heads, 2 KV heads: TP=2 splits both; vocab padded to the real
Qwen3's 151936, which splits too). Oracle: transformers' greedy
tokens on the same checkpoint, f32 (the same oracle test_vllm_offline.py holds a TP=1 run to). A
second server asked for more devices than there are must fail start-up with our error, not hang.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one
pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vllm_helpers import child_env, hf_greedy, root_conftest  # noqa: E402
from vllm_server import VllmServer, fake_devices_env, free_port, serve_cmd, vllm_servers  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

COMMON = [
    "--dtype",
    "float32",
    "--max-model-len",
    "128",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "64",
]
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "In 2024, 17 researchers published"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen3_tp_dir(tmp_path_factory) -> str:
    """The random Qwen3 with the real Qwen3's vocab_size (151936, its tokenizer has 151669 ids):
    the engine splits the vocab over the TP devices, so it must divide by N."""
    return root_conftest().build_random_checkpoint(
        "qwen3", str(tmp_path_factory.mktemp("vllm-qwen3-tp")), vocab_size=151936
    )


@pytest.fixture(scope="module")
def tp2(qwen3_tp_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-tp") / "tp2.log"
    with vllm_servers(
        [([qwen3_tp_dir, *COMMON, "--tensor-parallel-size", "2"], log, fake_devices_env(2))]
    ) as (srv,):
        yield srv


def test_greedy_completions_equal_transformers(tp2, qwen3_tp_dir):
    log = tp2.log(tail=200_000)
    assert "tensor_parallel_size=2: one tpuserve worker drives 2 JAX devices" in log
    # The worker's own start-up line: its engine built the 2-device mesh.
    assert "tensor parallel 2 over mesh {'data': 1, 'model': 2}" in log
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_tp_dir, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        r = tp2.client.completions.create(
            model="m",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        choice = r.choices[0]
        prompt_ids, token_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
        assert len(token_ids) == MAX_TOKENS and r.usage.completion_tokens == MAX_TOKENS
        assert token_ids == hf_greedy(hf, prompt_ids, MAX_TOKENS), prompt


def test_more_devices_than_there_are_fails_start_up_with_the_reason(qwen3_tp_dir, tmp_path):
    port = free_port()
    srv = VllmServer.spawn(
        serve_cmd(qwen3_tp_dir, port, *COMMON, "--tensor-parallel-size", "4"),
        tmp_path / "tp4.log",
        port,
        child_env(plugin=False, **fake_devices_env(2)),
    )
    rc = srv.wait_exit(timeout=600)
    log = srv.log(tail=200_000)
    assert rc != 0, log[-4000:]
    # The engine's ConfigError (raised in the worker's init_device), not a generic start-up failure.
    reason = [ln for ln in log.splitlines() if "ConfigError" in ln and "tensor_parallel_size=4" in ln]
    assert reason and re.search(r"\b2\b", reason[-1]), log[-6000:]  # it names the 2 devices there are

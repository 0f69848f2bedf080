"""vLLM's own benchmark client, ``vllm bench serve`` (from the vLLM venv that scripts/vllm_env.sh
builds), against a real ``tpuserve serve`` on the default model: the random dataset and a small
ShareGPT-format file (tests/server/data/sharegpt_tiny.json), streamed over /v1/completions and
/v1/chat/completions. Its saved result JSON must show every request completed, none failed, tokens
generated, and positive throughputs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import ModuleType

import pytest
from server_fixtures import running_server  # tests/server/server_fixtures.py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SHAREGPT = os.path.join(HERE, "data", "sharegpt_tiny.json")
MODEL = "SmolLM2-135M-Instruct"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _load_client_module() -> ModuleType:
    # benchmarks/ is not a package; load the helper the serving benchmark shares with this test.
    path = os.path.join(REPO, "benchmarks", "vllm_bench_client.py")
    spec = importlib.util.spec_from_file_location("vllm_bench_client", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there while building the class
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load_client_module()


@pytest.fixture(scope="module")
def vllm_python() -> str:
    # First run builds the venv (minutes); later runs reuse the cached one.
    built = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "vllm_env.sh")],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
    )
    assert built.returncode == 0, f"scripts/vllm_env.sh failed:\n{built.stderr[-4000:]}"
    return built.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from tpuserve.tpu_platform.loader.export import default_model_hf_dir

    return default_model_hf_dir()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(
        tmp_path_factory,
        "vllm-bench-server",
        "--no-warmup",
        "--max-model-len",
        "512",
        "--max-num-batched-tokens",
        "128",
        "--max-num-seqs",
        "8",
    )


def _check(result: dict, num_prompts: int) -> None:
    assert result["completed"] == num_prompts, result
    assert result["failed"] == 0, [e for e in result.get("errors", []) if e][:3]
    assert result["total_output_tokens"] > 0
    for key in (
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "duration",
        "mean_ttft_ms",
        "median_ttft_ms",
    ):
        value = float(result[key])
        assert value > 0 and value != float("inf"), (key, result[key])


def test_random_dataset_completions(bench, vllm_python, tokenizer_dir, server, tmp_path):
    n, out_len = 8, 16
    cfg = bench.BenchServeConfig(
        base_url=server.base_url,
        model=MODEL,
        tokenizer=tokenizer_dir,
        num_prompts=n,
        dataset="random",
        random_input_len=32,
        random_output_len=out_len,
        ignore_eos=True,
        temperature=0.0,
    )
    result, output = bench.run_bench_serve(vllm_python, cfg, str(tmp_path), "random", timeout=800)
    print(bench.report_block(output))
    _check(result, n)
    # With ignore_eos every request runs to max_tokens, and the client counts tokens from our
    # streamed usage chunk: exactly n * out_len.
    assert result["total_output_tokens"] == n * out_len
    assert result["output_lens"] == [out_len] * n


@pytest.mark.parametrize(
    "backend,endpoint", [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")]
)
def test_sharegpt_dataset(bench, vllm_python, tokenizer_dir, server, tmp_path, backend, endpoint):
    n = 12  # every conversation in the file
    cfg = bench.BenchServeConfig(
        base_url=server.base_url,
        model=MODEL,
        tokenizer=tokenizer_dir,
        num_prompts=n,
        dataset="sharegpt",
        dataset_path=SHAREGPT,
        sharegpt_output_len=16,
        backend=backend,
        endpoint=endpoint,
    )
    result, output = bench.run_bench_serve(
        vllm_python, cfg, str(tmp_path), f"sharegpt-{backend}", timeout=800
    )
    print(bench.report_block(output))
    _check(result, n)
    assert all(0 < k <= 16 for k in result["output_lens"]), result["output_lens"]

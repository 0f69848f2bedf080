"""Drive a server with vLLM's own benchmark client, ``vllm bench serve``, from the vLLM venv
(``scripts/vllm_env.sh`` prints its python), and read back the JSON result it saves.

Used by ``benchmarks/serving.py --client vllm-bench`` and by tests/server/test_vllm_bench_client.py.
It runs offline: the tokenizer comes from a local directory (``--tokenizer``), and the Hugging Face
hub is told not to reach out.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field


@dataclass
class BenchServeConfig:
    base_url: str  # http://host:port, without /v1
    model: str  # the served model name
    tokenizer: str  # local Hugging Face directory holding the tokenizer
    num_prompts: int
    dataset: str = "random"  # "random" or "sharegpt"
    dataset_path: str | None = None  # the ShareGPT-format JSON file (dataset "sharegpt")
    random_input_len: int = 32
    random_output_len: int = 16
    sharegpt_output_len: int | None = None  # fixed output length instead of the reply's
    backend: str = "openai"  # "openai" (= "vllm"): /v1/completions; "openai-chat": /v1/chat/completions
    endpoint: str = "/v1/completions"
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float | None = None  # None: the server's default
    seed: int = 0
    extra: list[str] = field(default_factory=list)


def bench_serve_argv(
    vllm_python: str, cfg: BenchServeConfig, result_dir: str, result_filename: str
) -> list[str]:
    """The ``vllm bench serve`` command line (via the module, so no console script is needed)."""
    argv = [
        vllm_python,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        cfg.backend,
        "--base-url",
        cfg.base_url,
        "--endpoint",
        cfg.endpoint,
        "--model",
        cfg.model,
        "--tokenizer",
        cfg.tokenizer,
        "--dataset-name",
        cfg.dataset,
        "--num-prompts",
        str(cfg.num_prompts),
        "--seed",
        str(cfg.seed),
        "--disable-tqdm",
        # --save-detailed keeps the per-request TTFTs, ITLs, output lengths and errors.
        "--save-result",
        "--save-detailed",
        "--result-dir",
        result_dir,
        "--result-filename",
        result_filename,
    ]
    if cfg.dataset == "random":
        argv += [
            "--random-input-len",
            str(cfg.random_input_len),
            "--random-output-len",
            str(cfg.random_output_len),
        ]
    elif cfg.dataset == "sharegpt":
        if not cfg.dataset_path:
            raise ValueError("the sharegpt dataset needs dataset_path")
        argv += ["--dataset-path", cfg.dataset_path]
        if cfg.sharegpt_output_len is not None:
            argv += ["--sharegpt-output-len", str(cfg.sharegpt_output_len)]
    else:
        raise ValueError(f"unsupported dataset {cfg.dataset!r}")
    if cfg.max_concurrency is not None:
        argv += ["--max-concurrency", str(cfg.max_concurrency)]
    if cfg.ignore_eos:
        argv.append("--ignore-eos")
    if cfg.temperature is not None:
        argv += ["--temperature", str(cfg.temperature)]
    return argv + list(cfg.extra)


def bench_env() -> dict[str, str]:
    """The environment for the client: offline hub, and no pytest variables leaking into it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def run_bench_serve(
    vllm_python: str, cfg: BenchServeConfig, result_dir: str, name: str, timeout: float = 1800.0
) -> tuple[dict, str]:
    """Run ``vllm bench serve`` once; returns (its saved result JSON, its console output).
    Raises RuntimeError (with the output's tail) if it exits non-zero or saves no result."""
    os.makedirs(result_dir, exist_ok=True)
    filename = f"{name}.json"
    argv = bench_serve_argv(vllm_python, cfg, result_dir, filename)
    proc = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=bench_env()
    )
    path = os.path.join(result_dir, filename)
    if proc.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(
            f"vllm bench serve failed (exit {proc.returncode}): {' '.join(argv)}\n{proc.stdout[-6000:]}"
        )
    with open(path) as f:
        return json.load(f), proc.stdout


def report_block(output: str) -> str:
    """The result table vllm bench prints (from its '=== Serving Benchmark Result ===' line on),
    without the noise the CPU build prints at exit."""
    lines = output.splitlines()
    start = next((i for i, ln in enumerate(lines) if "Serving Benchmark Result" in ln), None)
    if start is None:
        return ""
    end = next((i for i in range(len(lines) - 1, start, -1) if lines[i].startswith("=====")), len(lines) - 1)
    return "\n".join(lines[start : end + 1])

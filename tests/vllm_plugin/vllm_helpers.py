"""Helpers for the vLLM plugin tests (a uniquely named module: "conftest" is ambiguous here).

Nothing here imports vLLM: vLLM work happens in child processes (vllm_driver.py, ``vllm serve``),
each with the environment that picks its platform.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from moe_checkpoints import root_conftest  # noqa: F401  (tests/conftest.py as a module; re-exported)

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
DRIVER = os.path.join(HERE, "vllm_driver.py")

# The prompts of tests/tpu_platform/test_model_parity.py: mixed lengths, digits, non-ASCII.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "In 2024, 17 researchers published 3 papers on paged attention for TPUs and GPUs alike, "
    "with code, benchmarks and a long discussion of memory bandwidth.",
    "日本語のテキストと emoji 🎉 mixed.",
]


# The default model's servers here run its 30 layers in a scan: a cold XLA cache (CI's) then compiles
# one layer body per program instead of 30 copies (~10 s against ~70 s a program). The unrolled CPU
# default is what the main suite's engine tests run; the platform only passes the choice through.
SCAN = {"layer_loop": "scan"}
SCAN_ARGS = ["--additional-config", json.dumps(SCAN)]


def child_env(plugin: bool, **extra: str) -> dict[str, str]:
    """Environment for a vLLM child process, with our platform on (opt-in) or off (fallback)."""
    env = dict(os.environ)
    env.pop("TPUSERVE_VLLM_PLATFORM", None)
    if plugin:
        env["TPUSERVE_VLLM_PLATFORM"] = "1"
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU backend would take far more
    env.update(extra)
    return env


def run_driver(spec: dict, workdir: str, plugin: bool = True, timeout: float = 900) -> dict:
    """Run vllm_driver.py on ``spec`` in a child process; return its JSON result."""
    spec_path = os.path.join(workdir, "spec.json")
    out_path = os.path.join(workdir, "out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    proc = subprocess.run(
        [sys.executable, DRIVER, spec_path, out_path],
        env=child_env(plugin),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=workdir,
    )
    log = proc.stdout + proc.stderr
    with open(os.path.join(workdir, "driver.log"), "w") as f:
        f.write(log)
    if proc.returncode != 0 or not os.path.exists(out_path):
        raise AssertionError(f"vllm driver failed (rc={proc.returncode}):\n{log[-6000:]}")
    with open(out_path) as f:
        result = json.load(f)
    result["log"] = log
    return result


def resolve_engine_configs(cases: list[tuple[str, dict]]) -> list[str]:
    """vLLM's engine config for each ``(model, EngineArgs keywords)`` with our plugin, in one child
    process: "ACCEPTED <quantization> <quant config class> <cache dtype>" or "REFUSED <error>"."""
    code = f"""
from vllm.engine.arg_utils import EngineArgs
for model, kw in {cases!r}:
    try:
        cfg = EngineArgs(model=model, dtype="float32", max_model_len=128, **kw).create_engine_config()
        print("ACCEPTED", cfg.model_config.quantization, type(cfg.quant_config).__name__,
              cfg.cache_config.cache_dtype)
    except Exception as e:
        print("REFUSED", str(e).replace(chr(10), " ")[:600])
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(plugin=True), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ACCEPTED", "REFUSED"))]
    assert len(lines) == len(cases), proc.stdout + proc.stderr[-3000:]
    return lines


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (n tokens, KV-cached): the model-numerics oracle."""
    import torch

    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out

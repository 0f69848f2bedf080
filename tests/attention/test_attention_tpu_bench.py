"""benchmarks/attention_tpu.py at smoke sizes, its kernels interpreted: the chip's stages run code
CI has run."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest


@pytest.fixture(scope="module")
def bench():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "benchmarks", "attention_tpu.py")
    spec = importlib.util.spec_from_file_location("attention_tpu_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_attention_benchmark_checks_fp8_off_tpu(bench, tmp_path):
    """--kv-dtype fp8 (the chip's stage kernels-fp8): the fp8 checks run and pass, so the stage's
    code path is exercised."""
    out = tmp_path / "checks.json"
    argv = ["--smoke", "--checks-only", "--rpa-v3", "off", "--kv-dtype", "fp8", "--check-dtypes", "bfloat16"]
    assert bench.main(argv + ["--check-options", "plain", "--out", str(out)]) == 0
    checks = json.loads(out.read_text())["checks"]
    assert {c["dtype"] for c in checks} == {"bfloat16", "fp8"}
    assert all(c["passed"] and c["kv_write_exact"] for c in checks)


@pytest.mark.timeout(300)
def test_attention_benchmark_sweeps_prefill_chunks_off_tpu(bench, tmp_path):
    """The prefill sweep (stage prefill-sweep: block sizes for the 1 x 8192 MFU point): one row per
    (queries per block, KV pages per block), with the causal FLOPs counted (a 32-token chunk ending
    at 128 sees 97..128 keys a token)."""
    out = tmp_path / "sweep.json"
    argv = ["--smoke", "--sweep", "--sweep-prefill", "32x128", "--sweep-prefill-bqs", "8,16"]
    argv += [
        "--sweep-prefill-ppbs",
        "4",
        "--sweep-vmem-mib",
        "32",
        "--num-q-heads",
        "4",
        "--num-kv-heads",
        "2",
        "--head-dim",
        "64",
    ]
    assert bench.main(argv + ["--iters", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["sweep"]
    assert [(r["bq"], r["pages_per_block"]) for r in rows] == [(8, 4), (16, 4)]
    flops = 4 * 4 * 64 * sum(128 - 32 + i + 1 for i in range(32))
    assert all(r["tflops"] == pytest.approx(flops / (r["us"] * 1e-6) / 1e12) for r in rows)

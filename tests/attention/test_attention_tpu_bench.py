"""benchmarks/attention_tpu.py's sweeps at smoke sizes, the kernels interpreted: the chip's stages
run code CI has run."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(300)
def test_attention_benchmark_sweeps_prefill_chunks_off_tpu(tmp_path):
    """The prefill sweep (stage prefill-sweep: block sizes for the 1 x 8192 MFU point) at smoke
    sizes: one row per (queries per block, KV pages per block), with the causal FLOPs counted
    (a 32-token chunk ending at 128 sees 97..128 keys a token)."""
    import importlib.util
    import json
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "benchmarks", "attention_tpu.py")
    spec = importlib.util.spec_from_file_location("attention_tpu_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "sweep.json"
    argv = ["--smoke", "--sweep", "--sweep-prefill", "32x128", "--sweep-prefill-bqs", "8,16"]
    argv += ["--sweep-prefill-ppbs", "4", "--num-q-heads", "4", "--num-kv-heads", "2", "--head-dim", "64"]
    assert bench.main(argv + ["--iters", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["sweep"]
    assert [(r["bq"], r["pages_per_block"]) for r in rows] == [(8, 4), (16, 4)]
    flops = 4 * 4 * 64 * sum(128 - 32 + i + 1 for i in range(32))
    assert all(r["tflops"] == pytest.approx(flops / (r["us"] * 1e-6) / 1e12) for r in rows)

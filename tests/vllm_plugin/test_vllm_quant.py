"""``--quantization`` and ``--kv-cache-dtype fp8`` through vLLM with the plugin active.

vLLM (``vllm.LLM`` in a child process, vllm_driver.py) with ``quantization="fp8"`` and, separately,
``kv_cache_dtype="fp8"`` must give the same greedy tokens as our standalone engine with the same
setting on the same checkpoint (a random tiny Qwen3, f32, which vLLM's own quantization classes
would refuse: they take bf16/fp16 only). The FP8 run also checks that vLLM's KV block count is
sized by FP8 pages (one byte per element), that the worker's calibrated k/v scales are our
engine's, and the config-level part (methods and KV dtypes accepted or refused by name, vLLM's own
names for pre-quantized checkpoints, the refusal through ``vllm serve``) runs in one child process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one

from vllm_helpers import PROMPTS, child_env, resolve_engine_configs, run_driver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

VLLM_CLI = os.path.join(os.path.dirname(sys.executable), "vllm")
MAX_TOKENS = 24
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def ours(path, prompt_ids, **engine):
    """Our standalone engine's greedy tokens for ``prompt_ids`` (and the engine, for its state)."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = LLM(path, **ENGINE, **engine)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs], llm


def fp8_page_bytes(path: str, block_size: int = 16) -> int:
    """Bytes of one KV page over all layers with one-byte elements (K and V)."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * block_size * c["num_key_value_heads"] * head_dim


@pytest.fixture(scope="module")
def fp8_weights(qwen3_dir, tmp_path_factory):
    spec = {
        "engine": dict(
            model=qwen3_dir, dtype="float32", quantization="fp8", seed=0, num_gpu_blocks_override=24, **ENGINE
        ),
        "jobs": [{"kind": "generate", "prompts": PROMPTS, "params": GREEDY}],
    }
    return run_driver(spec, str(tmp_path_factory.mktemp("vllm-quant-fp8")))


# 100 FP8 pages; in the model dtype (f32) the same bytes would be 25.
KV_PAGES = 100


@pytest.fixture(scope="module")
def fp8_kv(qwen3_dir, tmp_path_factory):
    spec = {
        "engine": dict(
            model=qwen3_dir,
            dtype="float32",
            kv_cache_dtype="fp8",
            seed=0,
            kv_cache_memory_bytes=KV_PAGES * fp8_page_bytes(qwen3_dir),
            **ENGINE,
        ),
        "jobs": [{"kind": "generate", "prompts": PROMPTS, "params": GREEDY}],
    }
    return run_driver(spec, str(tmp_path_factory.mktemp("vllm-kv-fp8")))


def test_quantization_fp8_greedy_equals_our_engine(fp8_weights, qwen3_dir):
    assert fp8_weights["platform"] == "TpuservePlatform"
    log = fp8_weights["log"]
    assert "weights: fp8" in log, log[-3000:]  # our worker quantized online (W8A16)
    recs = fp8_weights["jobs"][0]["out"]
    prompt_ids = [r["prompt_token_ids"] for r in recs]
    mine, llm = ours(qwen3_dir, prompt_ids, quantization="fp8", num_gpu_blocks=24)
    assert llm.engine.worker.quantization == "fp8"
    for r, m in zip(recs, mine):
        assert len(r["token_ids"]) == MAX_TOKENS
        assert r["token_ids"] == m, "vLLM+plugin --quantization fp8 vs our engine quantization='fp8'"


def test_kv_cache_dtype_fp8_greedy_equals_our_engine_and_blocks_are_fp8_sized(fp8_kv, qwen3_dir):
    log = fp8_kv["log"]
    # vLLM sized its blocks by our FP8 page: the budget holds KV_PAGES of them (not KV_PAGES / 4).
    pages = re.search(
        r"KV cache: (\d+) pages of 16 tokens, float8_e4m3fn \(k_scale ([\d.e+-]+), "
        r"v_scale ([\d.e+-]+)\)",
        log,
    )
    assert pages, log[-3000:]
    assert int(pages.group(1)) == KV_PAGES
    recs = fp8_kv["jobs"][0]["out"]
    prompt_ids = [r["prompt_token_ids"] for r in recs]
    mine, llm = ours(qwen3_dir, prompt_ids, kv_cache_dtype="fp8", num_gpu_blocks=KV_PAGES)
    runner = llm.engine.runner
    assert runner.kv_cache.dtype.itemsize == 1
    # the same calibrated per-tensor scales (the checkpoint has none)
    assert float(pages.group(2)) == pytest.approx(runner.kv_scales[0], rel=1e-5)
    assert float(pages.group(3)) == pytest.approx(runner.kv_scales[1], rel=1e-5)
    for r, m in zip(recs, mine):
        assert len(r["token_ids"]) == MAX_TOKENS
        assert r["token_ids"] == m, "vLLM+plugin --kv-cache-dtype fp8 vs our engine kv_cache_dtype='fp8'"


def _with_quant_config(src: str, dst: str, qc: dict) -> str:
    """A copy of ``src``'s config (weights linked) whose config.json declares ``qc``: enough for
    vLLM's config-time checks, which read no weights."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


CT_GROUP = {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
}


def test_config_time_acceptance_and_refusals_by_name(qwen3_dir, tmp_path):
    ct_fp8 = _with_quant_config(
        qwen3_dir,
        str(tmp_path / "ct-fp8"),
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": dict(CT_GROUP, format="float-quantized")},
            "ignore": ["lm_head"],
        },
    )
    ct_int4 = _with_quant_config(
        qwen3_dir,
        str(tmp_path / "ct-int4"),
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "format": "pack-quantized",
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "strategy": "group",
                        "group_size": 128,
                        "symmetric": True,
                    },
                }
            },
            "ignore": ["lm_head"],
        },
    )
    hf_fp8 = _with_quant_config(
        qwen3_dir,
        str(tmp_path / "hf-fp8"),
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        },
    )
    awq = _with_quant_config(
        qwen3_dir,
        str(tmp_path / "awq"),
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    )
    pd = {"kv_transfer_config": {"kv_connector": "TpuservePDConnector", "kv_role": "kv_both"}}
    cases = [(qwen3_dir, dict(quantization=q)) for q in ("fp8", "mxfp4", "nvfp4", "awq", "gptq")]
    cases += [(qwen3_dir, dict(kv_cache_dtype=k)) for k in ("fp8", "fp8_e4m3", "fp8_e5m2")]
    cases += [
        (qwen3_dir, dict(kv_cache_dtype="fp8", **pd)),
        (ct_fp8, {}),
        (hf_fp8, {}),
        (hf_fp8, dict(quantization="fp8")),
        (ct_int4, {}),
        (awq, {}),
    ]
    lines = resolve_engine_configs(cases)
    (fp8, mxfp4, nvfp4, awq_flag, gptq, kv_fp8, kv_e4m3, kv_e5m2, kv_pd, ct, hf, hf_flag, int4, awq_ckpt) = (
        lines
    )
    # online methods on a dense f32 checkpoint: vLLM holds our marker config, not its torch one
    assert fp8 == "ACCEPTED fp8 TpuserveQuantConfig auto"
    assert mxfp4 == "ACCEPTED mxfp4 TpuserveQuantConfig auto"
    assert nvfp4 == "ACCEPTED nvfp4 TpuserveQuantConfig auto"  # not a vLLM name: registered by us
    for line, name in ((awq_flag, "awq"), (gptq, "gptq")):
        assert (
            line.startswith("REFUSED") and f"quantization {name!r} is not supported on the tpuserve" in line
        )
    assert kv_fp8 == "ACCEPTED None NoneType fp8" and kv_e4m3 == "ACCEPTED None NoneType fp8_e4m3"
    assert kv_e5m2.startswith("REFUSED") and "kv_cache_dtype='fp8_e5m2'" in kv_e5m2
    assert kv_pd.startswith("REFUSED") and "TpuservePDConnector" in kv_pd and "k/v scales" in kv_pd
    # pre-quantized: vLLM names the checkpoint's format itself; the formats our loader reads pass
    assert ct == "ACCEPTED compressed-tensors TpuserveQuantConfig auto"
    assert hf == "ACCEPTED fp8 TpuserveQuantConfig auto" and hf_flag == hf
    # ... and the rest are refused by name: by our loader's format check, or by vLLM's method name
    assert int4.startswith("REFUSED") and "pack-quantized" in int4, int4
    assert awq_ckpt.startswith("REFUSED") and "awq" in awq_ckpt and "tpuserve" in awq_ckpt, awq_ckpt


def test_vllm_serve_refuses_an_unsupported_method_by_name(qwen3_dir):
    proc = subprocess.run(
        [VLLM_CLI, "serve", qwen3_dir, "--device", "tpu", "--quantization", "gptq", "--max-model-len", "128"],
        env=child_env(plugin=False),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "quantization 'gptq' is not supported on the tpuserve platform" in proc.stdout + proc.stderr, (
        proc.stdout + proc.stderr
    )[-3000:]


@pytest.fixture(scope="module")
def ct_checkpoint(tmp_path_factory):
    """A compressed-tensors FP8 (per-channel) checkpoint written by compressed-tensors itself
    (tests/quant/ckpt_writers.py), from a random Llama whose dims it quantizes."""
    from vllm_helpers import root_conftest

    quant_tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "quant")
    sys.path.insert(0, quant_tests)
    try:
        import ckpt_writers as cw
    finally:
        sys.path.remove(quant_tests)
    base = tmp_path_factory.mktemp("vllm-ct")
    src = root_conftest().build_random_checkpoint(
        "llama",
        str(base / "src"),
        hidden_size=256,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return cw.write_compressed_tensors(src, str(base / "ct-fp8"), "FP8_DYNAMIC")


def test_prequantized_checkpoint_greedy_equals_our_engine(ct_checkpoint, tmp_path):
    # No flag: vLLM reads the checkpoint's quantization_config and names it "compressed-tensors";
    # our loader reads the FP8 records itself.
    spec = {
        "engine": dict(model=ct_checkpoint, dtype="float32", seed=0, num_gpu_blocks_override=24, **ENGINE),
        "jobs": [{"kind": "generate", "prompts": PROMPTS, "params": GREEDY}],
    }
    run = run_driver(spec, str(tmp_path))
    assert "weights: fp8" in run["log"], run["log"][-3000:]
    recs = run["jobs"][0]["out"]
    mine, llm = ours(ct_checkpoint, [r["prompt_token_ids"] for r in recs], num_gpu_blocks=24)
    assert llm.engine.worker.quantization == "fp8"
    for r, m in zip(recs, mine):
        assert len(r["token_ids"]) == MAX_TOKENS
        assert r["token_ids"] == m, "vLLM+plugin vs our engine on a pre-quantized checkpoint"

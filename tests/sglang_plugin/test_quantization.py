"""``--quantization`` and ``--kv-cache-dtype`` through SGLang's own launcher with the tpuserve platform.

Two real ``python -m sglang.launch_server`` runs on the default checkpoint (SmolLM2-135M, f32 on the
CPU): ``--quantization fp8`` and ``--kv-cache-dtype fp8_e4m3``. Each must give the same greedy
tokens as our standalone engine with the same setting (``LLM(path, quantization="fp8")`` /
``LLM(path, kv_cache_dtype="fp8_e4m3")``), and the server's own log must show that our worker
really quantized the weights / holds an FP8 cache with our engine's calibrated scales. A third
launch with ``--quantization awq`` must fail at start-up naming the flag. The other methods and KV
dtypes, and pre-quantized checkpoints' names, are checked at argument-resolution level (SGLang's
``prepare_server_args`` + ``resolve_once`` + ``ModelConfig``, as the launcher runs them) in one
child process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys

import pytest
from conftest import launch_sglang, resolve_server_args

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason='sglang is not installed here; run with "$(bash scripts/sglang_env.sh)"',
    ),
    pytest.mark.timeout(900),
]

MAX_NEW = 24
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
SUPPORTED_METHODS = "supported: fp8, mxfp4, nvfp4"
# One short request for the FP8 KV test: its launch is the expensive part.
KV_PROMPTS, KV_MAX_NEW = PROMPTS[:1], 8


def _env() -> dict[str, str]:
    env = dict(os.environ, SGLANG_PLATFORM="tpuserve")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_cmd(hf_dir: str, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        hf_dir,
        "--max-total-tokens",
        "4096",
        "--skip-server-warmup",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


@contextlib.contextmanager
def _server(hf_dir: str, log_path: str, *extra: str):
    """A launched SGLang server's URL (conftest.launch_sglang), stopped on exit."""
    with launch_sglang(hf_dir, log_path, *extra) as server:
        yield server.url


def _serve_and_generate(
    hf_dir: str, log_path: str, *extra: str, prompts=PROMPTS, max_new: int = MAX_NEW
) -> dict:
    """Launch, answer ``prompts`` greedily one by one, read the server info, stop; return it all."""
    import requests

    with _server(hf_dir, log_path, *extra) as url:
        outs = []
        for text in prompts:
            r = requests.post(
                url + "/generate",
                timeout=600,
                json={"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}},
            )
            r.raise_for_status()
            outs.append(r.json())
        info = requests.get(url + "/get_server_info", timeout=30).json()
    with open(log_path, errors="replace") as f:
        return {"outs": outs, "info": info, "log": f.read()}


def _reference(hf_dir: str, prompts=PROMPTS, max_new: int = MAX_NEW, **engine):
    """Our standalone engine's greedy output ids for ``prompts``, and the engine itself."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = LLM(hf_dir, dtype="float32", layer_loop="scan", warmup=False, **engine)  # as the servers (conftest)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.fixture(scope="module")
def fp8_weights_run(hf_dir, tmp_path_factory):
    return _serve_and_generate(
        hf_dir, str(tmp_path_factory.mktemp("sglang-fp8") / "server.log"), "--quantization", "fp8"
    )


@pytest.fixture(scope="module")
def fp8_kv_run(hf_dir, tmp_path_factory):
    return _serve_and_generate(
        hf_dir,
        str(tmp_path_factory.mktemp("sglang-kv") / "server.log"),
        "--kv-cache-dtype",
        "fp8_e4m3",
        prompts=KV_PROMPTS,
        max_new=KV_MAX_NEW,
    )


def test_quantization_fp8_quantizes_and_matches_standalone(fp8_weights_run, hf_dir):
    log = fp8_weights_run["log"]
    # SGLang's model config took our resolution, and our worker really quantized the weights.
    assert "tpuserve: --quantization fp8 -> weights served as fp8" in log, log[-4000:]
    assert "quantized online in" in log, log[-4000:]
    assert re.search(
        r"tpuserve JAX executor ready .*weights=fp8, KV cache \(30, 257, 16, 6, 64\) "
        r"in JAX \(256 pages x 16 tokens, [\d.]+ MiB, float32\)",
        log,
    ), log[-4000:]
    assert "SGLang scheduler -> TpuServeTpModelWorker (JAX cpu backend, weights fp8" in log
    ref, llm = _reference(hf_dir, quantization="fp8")
    assert llm.engine.worker.quantization == "fp8"
    got = [o["output_ids"] for o in fp8_weights_run["outs"]]
    assert got == ref, "SGLang --quantization fp8 vs our engine quantization='fp8'"


def test_kv_cache_dtype_fp8_e4m3_matches_standalone(fp8_kv_run, hf_dir):
    log = fp8_kv_run["log"]
    m = re.search(
        r"tpuserve JAX executor ready .*weights=dense, KV cache \(30, 257, 16, 6, 64\) in "
        r"JAX \(256 pages x 16 tokens, [\d.]+ MiB, float8_e4m3fn, k_scale ([\d.e+-]+), "
        r"v_scale ([\d.e+-]+)\)",
        log,
    )
    assert m, log[-4000:]
    # SGLang's bookkeeping records the FP8 dtype and still holds no torch KV buffer.
    assert "kv_cache_dtype=torch.float8_e4m3fn); torch KV pool bytes: 0" in log
    assert "KV Cache is allocated" not in log
    mem = fp8_kv_run["info"]["internal_states"][0]["memory_usage"]
    assert mem["kvcache"] == 0 and mem["token_capacity"] == 4096, mem
    # A cache about the server's size (ours must hold one 8192-token sequence: 512 pages + page 0).
    ref, llm = _reference(hf_dir, KV_PROMPTS, KV_MAX_NEW, kv_cache_dtype="fp8_e4m3", num_gpu_blocks=513)
    runner = llm.engine.runner
    assert runner.kv_cache.dtype.itemsize == 1
    assert float(m.group(1)) == pytest.approx(runner.kv_scales[0], rel=1e-5)
    assert float(m.group(2)) == pytest.approx(runner.kv_scales[1], rel=1e-5)
    got = [o["output_ids"] for o in fp8_kv_run["outs"]]
    assert got == ref, "SGLang --kv-cache-dtype fp8_e4m3 vs our engine kv_cache_dtype='fp8_e4m3'"


def test_unsupported_quantization_refused_at_launch(hf_dir):
    proc = subprocess.run(
        _launch_cmd(hf_dir, _free_port(), "--quantization", "awq"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "--quantization awq is not supported by the tpuserve SGLang platform" in out, out[-4000:]
    assert SUPPORTED_METHODS in out
    assert "Uvicorn running" not in out and "tpuserve JAX executor ready" not in out


def _checkpoint_with(hf_dir: str, dest: str, quant_config: dict) -> str:
    """``hf_dir`` with a ``quantization_config`` in its config.json (other files linked)."""
    os.makedirs(dest)
    for name in os.listdir(hf_dir):
        if name != "config.json":
            os.symlink(os.path.join(hf_dir, name), os.path.join(dest, name))
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant_config
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dest


def test_methods_and_kv_dtypes_at_resolution(hf_dir, tmp_path):
    hf_fp8 = _checkpoint_with(
        hf_dir,
        str(tmp_path / "hf-fp8"),
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
        },
    )
    ct_nvfp4 = _checkpoint_with(
        hf_dir,
        str(tmp_path / "ct-nvfp4"),
        {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "format": "nvfp4-pack-quantized",
                    "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                }
            },
            "ignore": ["lm_head"],
        },
    )
    awq = _checkpoint_with(
        hf_dir,
        str(tmp_path / "awq"),
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    )
    cases = {
        "mxfp4": (hf_dir, ["--quantization", "mxfp4"]),
        "nvfp4": (hf_dir, ["--quantization", "nvfp4"]),
        "gptq": (hf_dir, ["--quantization", "gptq"]),
        "w8a8_int8": (hf_dir, ["--quantization", "w8a8_int8"]),
        "kv_e4m3": (hf_dir, ["--kv-cache-dtype", "fp8_e4m3"]),
        "kv_e5m2": (hf_dir, ["--kv-cache-dtype", "fp8_e5m2"]),
        "kv_bf16": (hf_dir, ["--kv-cache-dtype", "bfloat16"]),
        "hf_fp8": (hf_fp8, []),
        "hf_fp8_flag": (hf_fp8, ["--quantization", "fp8"]),
        "hf_fp8_wrong": (hf_fp8, ["--quantization", "nvfp4"]),
        "ct_nvfp4": (ct_nvfp4, []),
        "ct_nvfp4_sglang_name": (ct_nvfp4, ["--quantization", "compressed-tensors"]),
        "awq_ckpt": (awq, []),
    }
    res = resolve_server_args(cases)
    # Online methods our worker serves: SGLang's model config carries them (mxfp4 is "Unknown" to
    # SGLang's own check on a CPU host; nvfp4 is not one of its argparse choices without us).
    assert res["mxfp4"]["quantization"] == "mxfp4", res["mxfp4"]
    assert res["nvfp4"]["quantization"] == "nvfp4", res["nvfp4"]
    for name in ("gptq", "w8a8_int8"):
        err = res[name]["error"]
        assert f"--quantization {name} is not supported by the tpuserve SGLang platform" in err, err
        assert SUPPORTED_METHODS in err, err
    assert res["kv_e4m3"]["kv_cache_dtype"] == "fp8_e4m3" and "error" not in res["kv_e4m3"]
    for name, value in (("kv_e5m2", "fp8_e5m2"), ("kv_bf16", "bfloat16")):
        err = res[name]["error"]
        assert f"--kv-cache-dtype {value} is not supported by the tpuserve SGLang platform" in err, err
        assert "supported: auto (the model dtype) and fp8_e4m3" in err, err
    # Pre-quantized checkpoints: served as they are, under our method name; the flag may name them.
    assert res["hf_fp8"]["quantization"] == "fp8" and res["hf_fp8"]["flag"] is None, res["hf_fp8"]
    assert res["hf_fp8_flag"]["quantization"] == "fp8", res["hf_fp8_flag"]
    assert "--quantization nvfp4 does not match the checkpoint" in res["hf_fp8_wrong"]["error"]
    assert res["ct_nvfp4"]["quantization"] == "nvfp4", res["ct_nvfp4"]
    assert res["ct_nvfp4_sglang_name"]["quantization"] == "nvfp4", res["ct_nvfp4_sglang_name"]
    err = res["awq_ckpt"]["error"]
    assert "quantized in a format the tpuserve SGLang platform cannot load" in err and "'awq'" in err, err

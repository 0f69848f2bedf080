"""Which platform vLLM picks, the ``--device`` flag, and what the platform refuses.

Platform resolution happens once per process, so each case runs in a child process with its own
environment and command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one

from vllm_helpers import child_env

pytestmark = pytest.mark.timeout(300)

VLLM_CLI = os.path.join(os.path.dirname(sys.executable), "vllm")
WHICH = "from vllm.platforms import current_platform; print('PLATFORM', type(current_platform).__name__)"


def python(code: str, plugin: bool, argv: list[str] | None = None, timeout: float = 120) -> str:
    prefix = f"import sys; sys.argv = {argv!r}\n" if argv else ""
    proc = subprocess.run(
        [sys.executable, "-c", prefix + code],
        env=child_env(plugin),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def platform_in_child(plugin: bool, argv: list[str] | None = None) -> str:
    out = python(WHICH, plugin, argv)
    return out.split("PLATFORM ")[-1].strip()


def test_without_opt_in_vllm_keeps_its_cpu_platform():
    assert platform_in_child(plugin=False) == "CpuPlatform"


def test_opt_in_by_environment():
    assert platform_in_child(plugin=True) == "TpuservePlatform"


def test_device_tpu_on_the_command_line_opts_in_and_adds_the_flag():
    # No environment opt-in: `--device tpu` alone selects the platform, which adds the flag.
    helped = subprocess.run(
        [VLLM_CLI, "serve", "--device", "tpu", "--help=device"],
        env=child_env(plugin=False),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "--device {tpu}" in helped.stdout, helped.stdout + helped.stderr


def test_device_flag_value_is_validated():
    bad = subprocess.run(
        [VLLM_CLI, "serve", "/nonexistent", "--device", "cuda"],
        env=child_env(plugin=True),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "invalid choice: 'cuda'" in bad.stderr, bad.stderr


def test_parser_hook_in_process():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tpuserve.tpu_platform.vllm_plugin.platform import TpuservePlatform

    parser = FlexibleArgumentParser()
    TpuservePlatform.pre_register_and_update(parser)
    TpuservePlatform.pre_register_and_update(parser)  # idempotent
    assert parser.parse_args(["--device", "TPU"]).device == "tpu"
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "gpu"])


def test_unsupported_requests_are_refused_in_the_front_end():
    from vllm import SamplingParams

    from tpuserve.tpu_platform.vllm_plugin.platform import TpuservePlatform

    TpuservePlatform.validate_request({"type": "token"}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="logit_bias"):
        TpuservePlatform.validate_request({"type": "token"}, SamplingParams(logit_bias={1: 1.0}))
    with pytest.raises(ValueError, match="generation requests only"):
        TpuservePlatform.validate_request({"type": "token"}, SimpleNamespace())


def test_config_hook_sets_worker_and_refuses_unsupported(default_hf_dir):
    code = f"""
from vllm.engine.arg_utils import EngineArgs
cfg = EngineArgs(model={default_hf_dir!r}, dtype="float32", max_model_len=256).create_engine_config()
print("WORKER", cfg.parallel_config.worker_cls)
print("EXECUTOR", cfg.parallel_config.distributed_executor_backend)
print("BLOCK", cfg.cache_config.block_size)
print("ASYNC", cfg.scheduler_config.async_scheduling)
for bad in (dict(kv_cache_dtype="fp8_e5m2"), dict(enable_lora=True),
            dict(additional_config={{"attention_impl": "nope"}}),
            dict(additional_config={{"typo": 1}}),
            dict(additional_config={{"layer_loop": "loop"}})):
    try:
        EngineArgs(model={default_hf_dir!r}, dtype="float32", max_model_len=256, **bad).create_engine_config()
        print("ACCEPTED", bad)
    except Exception as e:
        print("REFUSED", type(e).__name__, str(e).replace(chr(10), " ")[:300])
"""
    out = python(code, plugin=True, timeout=240)
    assert "WORKER tpuserve.tpu_platform.vllm_plugin.worker.TpuserveWorker" in out
    assert "EXECUTOR uni" in out and "BLOCK 16" in out and "ASYNC False" in out
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert "ACCEPTED" not in out, out
    assert len(refused) == 5, out
    assert "kv_cache_dtype='fp8_e5m2'" in refused[0] and "LoRA" in refused[1]  # fp8 (e4m3) is served
    assert "attention_impl" in refused[2] and "typo" in refused[3]
    assert "layer_loop='loop'" in refused[4] and "unroll" in refused[4]

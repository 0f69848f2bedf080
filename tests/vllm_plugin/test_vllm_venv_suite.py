"""From the main test venv (``bash scripts/test.sh``, ``.ci/run``): run this directory's tests in the
vLLM venv, which ``scripts/vllm_env.sh`` builds once (cached) and prints the python of.

vLLM pins its own torch and transformers, so it cannot share the main venv; this one test is the
bridge. In the vLLM venv itself it skips (the tests there run directly).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
INNER_TIMEOUT_S = 3000

pytestmark = [pytest.mark.slow, pytest.mark.timeout(INNER_TIMEOUT_S + 1200)]


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="already in the vLLM venv: the plugin tests run directly here",
)
def test_plugin_suite_passes_in_the_vllm_venv(tmp_path):
    # First run builds the venv (~4 min, several GB); later runs reuse it and reinstall us editable.
    built = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "vllm_env.sh")],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
    )
    assert built.returncode == 0, f"scripts/vllm_env.sh failed:\n{built.stderr[-4000:]}"
    python = built.stdout.strip().splitlines()[-1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("TPUSERVE_VLLM_PLATFORM", None)  # each test picks its platform itself
    log = tmp_path / "vllm_plugin_tests.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [python, "-m", "pytest", HERE, "-q", "-p", "no:cacheprovider", "-rs", "--durations=5"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=INNER_TIMEOUT_S,
        )
    text = log.read_text()
    summary = text.strip().splitlines()[-1] if text.strip() else "(no output)"
    print(f"vLLM venv: {python}\n{summary}")
    assert proc.returncode == 0, f"plugin tests failed in the vLLM venv:\n{text[-8000:]}"
    # Inside, only the bridge test itself may skip: a missing dependency there must not pass quietly.
    skipped = re.search(r"(\d+) skipped", summary)
    assert " passed" in summary and (skipped is None or int(skipped.group(1)) <= 1), summary

"""``vllm serve --device tpu --kv-offloading-size 1``: vLLM's prefix cache gets our host tier.

A tiny device pool (``--num-gpu-blocks-override``) forces vLLM to evict cached prefixes; the same
prompts sent again must then come back from host memory. Oracles are vLLM's own: the cold greedy
completion of each prompt (served first, with no cached tokens), the ``cached_tokens`` vLLM reports
per request, and its Prometheus counters, where vLLM files the connector's hits under
``source="host"`` (``vllm:prompt_tokens_cached_by_source``); our connector's counter of blocks it
actually scattered back says the worker did the loading.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from vllm_helpers import SCAN_ARGS, child_env  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VLLM_CLI = os.path.join(os.path.dirname(sys.executable), "vllm")
BLOCK = 16
DEVICE_BLOCKS = 56  # vLLM's block 0 is reserved: 55 usable, four of the prompts below (12 blocks each)


def _doc(topic: str, n: int = 8) -> str:
    """About 160 tokens (10 full blocks) whose first block already differs by topic."""
    lines = [
        f"Notes on the {topic}, kept by the archive."
        + "".join(
            f" Entry {i} of the {topic} file says item {i * 7} arrived on day {i + 3}." for i in range(n)
        )
    ]
    return lines[0] + "\nQuestion: which item arrived on day 5?\nAnswer:"


PROMPTS = [_doc(t) for t in ("museum", "harbour", "library", "observatory")]
FLOOD = [_doc(t) for t in ("river", "forest", "castle", "bridge", "market", "garden")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(default_hf_dir, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm-offload") / "server.log"
    cmd = [
        VLLM_CLI,
        "serve",
        default_hf_dir,
        "--device",
        "tpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "128",
        "--num-gpu-blocks-override",
        str(DEVICE_BLOCKS),
        "--kv-offloading-size",
        "1",
        "--enable-prompt-tokens-details",
        "--served-model-name",
        "m",
        *SCAN_ARGS,
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=child_env(plugin=False), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
    deadline = time.monotonic() + 600
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"vllm serve exited (rc={proc.returncode}):\n{log_path.read_text()[-6000:]}"
                )
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"vllm serve did not come up:\n{log_path.read_text()[-6000:]}"
                    ) from None
                time.sleep(2)
        yield client, port, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _complete(client, prompt: str) -> tuple[str, int, int]:
    r = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    details = r.usage.prompt_tokens_details
    return r.choices[0].text, r.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0


def _counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{")[0]
        if 'source="host"' in name:
            key += ":host"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def test_evicted_prefixes_come_back_from_host_with_identical_greedy_output(server):
    client, port, log_path = server
    assert "host-memory KV tier via TpuserveHostOffloadConnector" in log_path.read_text()
    cold = {}
    for p in PROMPTS:
        text, n_prompt, cached = _complete(client, p)
        assert cached == 0, (p[:40], cached)  # nothing of it was seen before: computed from scratch
        assert n_prompt >= 10 * BLOCK
        cold[p] = (text, n_prompt)
    before = _counters(port)
    for p in FLOOD:  # more blocks than the device holds: the prompts above leave vLLM's device cache
        _complete(client, p)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # the reloads run together, loads in shared steps
        again = dict(zip(PROMPTS, pool.map(lambda p: _complete(client, p), PROMPTS)))
    after = _counters(port)

    for p in PROMPTS:
        text, n_prompt, cached = again[p]
        assert text == cold[p][0], (p[:40], text, cold[p][0])
        # Every full block before the one holding the last prompt token: from device or host.
        assert cached == (n_prompt - 1) // BLOCK * BLOCK, (p[:40], cached, n_prompt)
    host_tokens = after["vllm:prompt_tokens_cached_by_source_total:host"] - before.get(
        "vllm:prompt_tokens_cached_by_source_total:host", 0.0
    )
    loaded = after["vllm:tpuserve_host_tier_loaded_blocks_total"] - before.get(
        "vllm:tpuserve_host_tier_loaded_blocks_total", 0.0
    )
    assert host_tokens > 0 and loaded > 0, (host_tokens, loaded)
    assert loaded * BLOCK == host_tokens  # what the scheduler counted is what the worker moved
    assert after["vllm:tpuserve_host_tier_stored_blocks_total"] >= len(PROMPTS + FLOOD) * 10
    assert after["vllm:tpuserve_host_tier_load_bytes_total"] > 0

"""Two ``vllm serve --device tpu`` behind ``tpuserve router``: prefill on one, decode on the other.

P runs ``TpuservePDConnector`` as ``kv_producer``, D as ``kv_consumer`` (``--kv-transfer-config``
with our module path), both with the same ``TPUSERVE_KV_SECRET``. Oracles are vLLM's own: the greedy
completions of a third, plain ``vllm serve`` of the same model; the ``kv_transfer_params`` vLLM puts
in P's HTTP response; and D's prompt-token counters by source, where vLLM files tokens a connector
loaded from another instance as ``source="p2p"`` (so D computed only each prompt's last token).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from vllm_helpers import SCAN_ARGS, child_env  # noqa: E402
from vllm_server import VllmServer, free_port, vllm_servers  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

COMMON = [
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "64",
    *SCAN_ARGS,
]
SECRET = {"TPUSERVE_KV_SECRET": "pd-test-secret-0123456789abcdef"}
PROMPTS = [
    "The capital of France is",
    "Background notes. The museum opens at nine in the morning and closes at six in the evening. "
    "Tickets cost twelve euros for adults and six for children. Question: when does it close?",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "List three colours of the rainbow:",
]


def _pd_config(role: str, port: int) -> str:
    return json.dumps(
        {
            "kv_connector": "TpuservePDConnector",
            "kv_connector_module_path": "tpuserve.tpu_platform.vllm_plugin.pd_connector",
            "kv_role": role,
            "kv_port": port,
        }
    )


@pytest.fixture(scope="module")
def cluster(default_hf_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-pd")
    specs = [
        ([default_hf_dir, *COMMON], logs / "single.log", None),
        (
            [default_hf_dir, *COMMON, "--kv-transfer-config", _pd_config("kv_producer", free_port())],
            logs / "prefill.log",
            SECRET,
        ),
        (
            [default_hf_dir, *COMMON, "--kv-transfer-config", _pd_config("kv_consumer", free_port())],
            logs / "decode.log",
            SECRET,
        ),
    ]
    with vllm_servers(specs) as (single, prefill, decode):
        port = free_port()
        router = VllmServer.spawn(
            [
                os.path.join(os.path.dirname(os.sys.executable), "tpuserve"),
                "router",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--port",
                str(port),
            ],
            logs / "router.log",
            port,
            child_env(plugin=False),
        )
        try:
            router.wait_ready(timeout=120, path="/health")
            yield single, prefill, decode, router
        finally:
            router.stop()


def _prompt_tokens_by_source(srv) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{srv.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:prompt_tokens_cached_by_source_total{"):
            source = line.split('source="')[1].split('"')[0]
            key = line.split("{")[0] + ":" + source
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_prefill_returns_transfer_params(cluster):
    _, prefill, _, _ = cluster
    r = httpx.post(
        f"{prefill.url}/v1/completions",
        timeout=300,
        json={
            "model": "m",
            "prompt": PROMPTS[0],
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    ).json()
    p = r["kv_transfer_params"]
    assert p["do_remote_prefill"] is True and p["remote_host"] == "127.0.0.1"
    assert p["remote_num_tokens"] == r["usage"]["prompt_tokens"] and p["remote_num_pages"] >= 1
    assert len(p["remote_transfer_id"]) == 32 and len(p["layout_digest"]) == 64


def test_router_greedy_output_equals_single_server(cluster):
    single, _, decode, router = cluster
    before = _prompt_tokens_by_source(decode)

    def complete(srv, prompt):
        r = srv.client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0)
        return r.choices[0].text, r.usage.prompt_tokens

    want = [complete(single, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # decodes share steps on D
        got = list(pool.map(lambda p: complete(router, p), PROMPTS))
    assert got == want
    after = _prompt_tokens_by_source(decode)
    p2p = after.get("vllm:prompt_tokens_cached_by_source_total:p2p", 0.0) - before.get(
        "vllm:prompt_tokens_cached_by_source_total:p2p", 0.0
    )
    # Every prompt came over the wire (vLLM then recomputes the last token, to sample after it).
    assert sum(n - 1 for _, n in want) <= p2p <= sum(n for _, n in want), (p2p, after)

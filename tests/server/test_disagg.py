"""Disaggregated prefill/decode end to end: a producer and a consumer ``tpuserve serve``, each in its
own process on loopback, and the router in front. The oracle is the consumer serving the same
request alone (a single engine): greedy output must match, and the decode side must not have
computed the prompt (its usage reports the transferred tokens as cached)."""

from __future__ import annotations

import json

import httpx
import pytest

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv

pytestmark = pytest.mark.timeout(600)

SECRET = "pd-test-secret-0123456789abcdef"
FLAGS = [
    "--max-model-len",
    "256",
    "--max-num-batched-tokens",
    "64",
    "--max-num-seqs",
    "8",
    "--no-warmup",
    "--served-model-name",
    "tiny",
]
PROMPTS = [
    "The history of the lighthouse on the northern cape begins in 1871 when",
    "A short list of things to pack for a week of hiking in the mountains: water, ",
    "Once upon a time",
]


def _serve(ckpt, logs, name, role, policy="fail", secret=SECRET):
    port = free_port()
    cfg = json.dumps({"kv_role": role, "kv_port": 0, "kv_load_failure_policy": policy})
    srv = ServerProcess(
        tpuserve_argv("serve", ckpt, *FLAGS, "--port", str(port), "--kv-transfer-config", cfg),
        port,
        env={"JAX_PLATFORMS": "cpu", "TPUSERVE_KV_SECRET": secret},
        log_path=str(logs / f"{name}.log"),
    )
    srv.start()
    return srv


@pytest.fixture(scope="module")
def pd(random_checkpoints, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    ckpt = random_checkpoints["qwen3"]  # has a chat template
    procs = {}
    try:
        procs["prefill"] = _serve(ckpt, logs, "prefill", "kv_producer")
        procs["decode"] = _serve(ckpt, logs, "decode", "kv_consumer")
        procs["recompute"] = _serve(ckpt, logs, "recompute", "kv_consumer", policy="recompute")
        procs["wrong_secret"] = _serve(ckpt, logs, "wrong", "kv_consumer", secret="another-secret-0123456789")
        port = free_port()
        router = ServerProcess(
            tpuserve_argv(
                "router",
                "--prefill",
                procs["prefill"].base_url,
                "--decode",
                procs["decode"].base_url,
                "--port",
                str(port),
            ),
            port,
            log_path=str(logs / "router.log"),
            startup_timeout=120,
        )
        router.start()
        procs["router"] = router
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _post(srv, body, path="/v1/completions"):
    return httpx.post(srv.base_url + path, json=body, timeout=300)


def _prefill(pd, prompt):
    r = _post(
        pd["prefill"],
        {
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_host"] == "127.0.0.1"
    return params


def test_pd_greedy_output_equals_a_single_engine_and_skips_the_prompt(pd):
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        single = _post(pd["decode"], body).json()
        params = _prefill(pd, prompt)
        got = _post(pd["decode"], dict(body, kv_transfer_params=params)).json()
        assert got["choices"][0]["text"] == single["choices"][0]["text"]
        n = got["usage"]["prompt_tokens"]
        assert params["remote_num_tokens"] == n
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
        # The lease ended with the pull: the same params cannot be used twice.
        again = _post(pd["decode"], dict(body, kv_transfer_params=params))
        assert again.status_code == 502 and "KV" in again.json()["error"]["message"]


def test_through_the_router(pd):
    body = {"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    direct = _post(pd["decode"], body).json()["choices"][0]["text"]
    via = _post(pd["router"], body)
    assert via.status_code == 200, via.text
    assert via.json()["choices"][0]["text"] == direct
    chat = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, "temperature": 0}
    a = _post(pd["router"], chat, "/v1/chat/completions").json()["choices"][0]["message"]["content"]
    b = _post(pd["decode"], chat, "/v1/chat/completions").json()["choices"][0]["message"]["content"]
    assert a == b


def test_failure_policies_and_wrong_secret(pd):
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    single = _post(pd["decode"], body).json()["choices"][0]["text"]
    bad = _post(pd["wrong_secret"], dict(body, kv_transfer_params=_prefill(pd, PROMPTS[1])))
    assert bad.status_code == 502 and "secret" in bad.text.lower()
    gone = dict(_prefill(pd, PROMPTS[1]), remote_transfer_id="0" * 32)
    rec = _post(pd["recompute"], dict(body, kv_transfer_params=gone))
    assert rec.status_code == 200 and rec.json()["choices"][0]["text"] == single
    assert rec.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _post(pd["decode"], dict(body, kv_transfer_params={"do_remote_prefill": True})).status_code == 400
    # Every server is still healthy after the failures.
    for name in ("prefill", "decode", "recompute", "wrong_secret"):
        assert httpx.get(pd[name].base_url + "/health").status_code == 200


def test_producer_killed_consumers_fail_or_recompute_and_free_pages(pd):
    """Runs last: kills the producer holding a lease. The fail-policy consumer answers 502 at once,
    the recompute-policy consumer answers the single-engine output, the router answers 502/503 for
    new requests, and every surviving server ends with no KV page in use."""
    import time

    body = {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    single = _post(pd["decode"], body).json()["choices"][0]["text"]
    leases = [_prefill(pd, PROMPTS[2]), _prefill(pd, PROMPTS[2])]
    pd["prefill"].proc.kill()
    pd["prefill"].proc.wait(30)
    t = time.monotonic()
    failed = _post(pd["decode"], dict(body, kv_transfer_params=leases[0]))
    assert failed.status_code == 502 and time.monotonic() - t < 60
    rec = _post(pd["recompute"], dict(body, kv_transfer_params=leases[1]))
    assert rec.status_code == 200 and rec.json()["choices"][0]["text"] == single
    via = httpx.post(pd["router"].base_url + "/v1/completions", json=body, timeout=120)
    assert via.status_code in (502, 503) and "error" in via.json()
    for name in ("decode", "recompute"):
        metrics = httpx.get(pd[name].base_url + "/metrics").text
        usage = [line for line in metrics.splitlines() if line.startswith("vllm:kv_cache_usage_perc")]
        assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0.0, usage

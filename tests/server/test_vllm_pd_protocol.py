"""vLLM's disaggregated prefill/decode request protocol, as routers written for vLLM speak it.

The proxy here is our own re-implementation of the request flow of vLLM's example P/D proxy
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``) and of llm-d's routing sidecar
(``internal/proxy/connector_nixlv2.go``), from their protocol, not their code:

* prefill request: the client's body with ``stream=false``, ``max_tokens=1`` (and
  ``max_completion_tokens=1``), no ``stream_options`` and ``kv_transfer_params`` =
  ``{do_remote_decode: true, do_remote_prefill: false, remote_engine_id / remote_block_ids /
  remote_host / remote_port: null}``; the toy proxy also drops ``min_tokens``.
* decode request: the client's body plus the ``kv_transfer_params`` of the prefill response, as
  returned (the toy proxy only when non-empty; the sidecar always, null included).

It drives a real tpuserve producer and consumer; greedy output must equal a plain (not
disaggregated) engine's, and the consumer must compute only the prompt's last token.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid

import httpx
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv

pytestmark = pytest.mark.timeout(600)

SECRET = "pd-vllm-proto-secret-0123456789"
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
PROMPT = "The history of the lighthouse on the northern cape begins in 1871 when"
NULL_PLACEHOLDERS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")


def _serve(ckpt, logs, name, role):
    port = free_port()
    cfg = json.dumps({"kv_role": role, "kv_port": 0, "engine_id": f"{name}-engine"})
    srv = ServerProcess(
        tpuserve_argv("serve", ckpt, *FLAGS, "--port", str(port), "--kv-transfer-config", cfg),
        port,
        env={"JAX_PLATFORMS": "cpu", "TPUSERVE_KV_SECRET": SECRET},
        log_path=str(logs / f"{name}.log"),
    )
    srv.start()
    return srv


def vllm_style_proxy(prefill_url: str, decode_url: str, flavor: str, seen: list) -> Starlette:
    """A P/D proxy that speaks only vLLM's protocol. ``flavor`` picks the toy proxy's or the llm-d
    sidecar's small differences; ``seen`` collects (prefill response params, decode body)."""

    def prefill_body(body: dict) -> dict:
        out = dict(body)
        out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        out["kv_transfer_params"].update(dict.fromkeys(NULL_PLACEHOLDERS))
        out.update(stream=False, max_tokens=1)
        out.pop("stream_options", None)
        if flavor == "toy":
            if "max_completion_tokens" in out:
                out["max_completion_tokens"] = 1
            out.pop("min_tokens", None)  # the toy proxy says P does not support it
            out.pop("min_completion_tokens", None)
        else:
            out["max_completion_tokens"] = 1  # the sidecar sets it on every endpoint
        return out

    async def handle(request: Request):
        body = await request.json()
        api = request.url.path
        rid = str(uuid.uuid4())
        # The toy proxy sends "Bearer <OPENAI_API_KEY>", i.e. "Bearer None" when unset.
        headers = {"X-Request-Id": rid, "Authorization": "Bearer None"}
        async with httpx.AsyncClient(timeout=300) as c:
            p = await c.post(prefill_url + api, json=prefill_body(body), headers=headers)
            if p.status_code != 200:
                return JSONResponse(p.json(), p.status_code)
            params = p.json().get("kv_transfer_params")
        decode = dict(body)
        if flavor == "sidecar" or params:
            decode["kv_transfer_params"] = params
        seen.append((params, decode))
        client = httpx.AsyncClient(timeout=300)
        resp = await client.send(
            client.build_request("POST", decode_url + api, json=decode, headers=headers), stream=True
        )

        async def relay():
            try:
                async for chunk in resp.aiter_bytes():
                    yield chunk
            finally:
                await resp.aclose()
                await client.aclose()

        return StreamingResponse(
            relay(), resp.status_code, media_type=resp.headers.get("content-type", "application/json")
        )

    return Starlette(
        routes=[Route(p, handle, methods=["POST"]) for p in ("/v1/completions", "/v1/chat/completions")]
    )


class _Proxy:
    """Serve an ASGI app with uvicorn on a thread of this process."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def pd(random_checkpoints, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-vllm")
    ckpt = random_checkpoints["qwen3"]  # has a chat template
    procs = {}
    try:
        procs["prefill"] = _serve(ckpt, logs, "prefill", "kv_producer")
        procs["decode"] = _serve(ckpt, logs, "decode", "kv_consumer")
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _computed_prompt_tokens(srv) -> float:
    """The consumer's ``vllm:prompt_tokens``: prompt tokens its engine ran through the model."""
    text = httpx.get(srv.base_url + "/metrics", timeout=30).text
    m = re.search(r"^vllm:prompt_tokens(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert m, "vllm:prompt_tokens missing from /metrics"
    return float(m.group(1))


def _check_vllm_params(params: dict, srv_name: str) -> None:
    """The keys vLLM's NixlConnector returns from a prefill, with vLLM's types."""
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == f"{srv_name}-engine"
    ids = params["remote_block_ids"]
    assert ids and all(type(i) is int and i >= 0 for i in ids)
    assert len(ids) == params["remote_num_pages"]
    assert params["remote_host"] == "127.0.0.1" and type(params["remote_port"]) is int
    assert params["tp_size"] == 1 and isinstance(params["remote_request_id"], str)


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["toy", "sidecar"])
def test_a_vllm_pd_proxy_drives_producer_and_consumer(pd, flavor):
    seen: list = []
    app = vllm_style_proxy(pd["prefill"].base_url, pd["decode"].base_url, flavor, seen)
    plain = openai.OpenAI(base_url=pd["prefill"].base_url + "/v1", api_key="x")
    with _Proxy(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        args = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True})

        # /v1/completions, not streamed (usage says how much of the prompt was imported).
        prompt = PROMPT if flavor == "toy" else PROMPT + " the keeper"
        want = plain.completions.create(prompt=prompt, max_tokens=10, **args)
        before = _computed_prompt_tokens(pd["decode"])
        got = client.completions.create(prompt=prompt, max_tokens=10, **args)
        assert got.choices[0].text == want.choices[0].text
        n = got.usage.prompt_tokens
        assert got.usage.prompt_tokens_details.cached_tokens == n - 1
        assert _computed_prompt_tokens(pd["decode"]) - before == 1  # only the last prompt token
        params, decode_body = seen[-1]
        _check_vllm_params(params, "prefill")
        assert params["remote_num_tokens"] == n
        assert decode_body["kv_transfer_params"] == params and decode_body["max_tokens"] == 10

        # /v1/chat/completions, streamed, with max_completion_tokens (both proxies rewrite it).
        messages = [{"role": "user", "content": f"Tell me about lighthouses ({flavor})"}]
        chat = dict(messages=messages, max_completion_tokens=8, **args)
        want_chat = plain.chat.completions.create(**chat).choices[0].message.content
        before = _computed_prompt_tokens(pd["decode"])
        stream = client.chat.completions.create(stream=True, **chat)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == want_chat
        assert _computed_prompt_tokens(pd["decode"]) - before == 1
        params, decode_body = seen[-1]
        _check_vllm_params(params, "prefill")
        assert decode_body["stream"] is True and decode_body["max_completion_tokens"] == 8


def test_prefill_request_as_vllm_proxies_send_it(pd):
    """The producer accepts the null placeholders and answers vLLM's keys next to ours; a
    consumer fed exactly those params (as a proxy forwards them) imports the prompt."""
    body = {"prompt": "Once upon a time", "max_tokens": 1, "temperature": 0}
    kv = {"do_remote_decode": True, "do_remote_prefill": False, **dict.fromkeys(NULL_PLACEHOLDERS)}
    r = httpx.post(
        pd["prefill"].base_url + "/v1/completions", json=dict(body, kv_transfer_params=kv), timeout=300
    )
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    _check_vllm_params(params, "prefill")
    d = httpx.post(
        pd["decode"].base_url + "/v1/completions",
        json=dict(body, max_tokens=3, kv_transfer_params=params),
        timeout=300,
    )
    assert d.status_code == 200, d.text
    assert d.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == params["remote_num_tokens"] - 1
    # The sidecar forwards a missing kv_transfer_params as null: a plain request.
    plain = httpx.post(
        pd["decode"].base_url + "/v1/completions", json=dict(body, kv_transfer_params=None), timeout=300
    )
    assert plain.status_code == 200, plain.text


BAD = [
    ("prefill", {"do_remote_decode": "yes"}, "do_remote_decode"),
    ("prefill", {"do_remote_decode": True, "remote_port": "80"}, "remote_port"),
    ("prefill", {"do_remote_decode": True, "remote_port": 70000}, "remote_port"),
    ("prefill", {"do_remote_decode": True, "remote_block_ids": ["a"]}, "remote_block_ids"),
    ("prefill", {"do_remote_decode": True, "remote_block_ids": 3}, "remote_block_ids"),
    ("prefill", {"do_remote_decode": True, "remote_engine_id": 5}, "remote_engine_id"),
    ("prefill", {"do_remote_decode": True, "tp_size": 0}, "tp_size"),
    ("decode", {"do_remote_prefill": 1}, "do_remote_prefill"),
    ("decode", {"do_remote_prefill": True, "remote_host": ["h"]}, "remote_host"),
    # A vLLM (NIXL) producer's params carry no lease id: say so instead of failing a pull.
    (
        "decode",
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "nixl-engine",
            "remote_block_ids": [1, 2],
            "remote_request_id": "r",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        },
        "remote_transfer_id",
    ),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_kv_transfer_params_answer_400_naming_the_key(pd, path):
    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            for srv, kv, key in BAD:
                body = {"max_tokens": 2, "kv_transfer_params": kv}
                if path.endswith("chat/completions"):
                    body["messages"] = [{"role": "user", "content": "hi"}]
                else:
                    body["prompt"] = "hi"
                r = await c.post(pd[srv].base_url + path, json=body)
                assert r.status_code == 400, (kv, r.text)
                err = r.json()["error"]
                assert f"kv_transfer_params.{key}" in err["message"], (kv, err)

    asyncio.run(run())
    for srv in ("prefill", "decode"):
        assert httpx.get(pd[srv].base_url + "/health", timeout=30).status_code == 200

"""Concurrency and client disconnects against a real ``tpuserve serve`` process (tiny random Qwen3)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tpuserve.server.launcher import ServerProcess, free_port, tpuserve_argv

pytestmark = pytest.mark.timeout(900)  # the fixture warms up every shape bucket first

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(random_checkpoints, tmp_path_factory):
    port = free_port()
    log = str(tmp_path_factory.mktemp("load-server") / "server.log")
    srv = ServerProcess(
        tpuserve_argv(
            "serve",
            random_checkpoints["qwen3"],
            "--port",
            str(port),
            "--served-model-name",
            MODEL,
            "--max-model-len",
            "512",
            "--max-num-batched-tokens",
            "128",
            "--max-num-seqs",
            "64",
            "--num-gpu-blocks",
            "1200",
        ),
        port,
        env={"JAX_PLATFORMS": "cpu"},
        log_path=log,
    )
    srv.start()
    yield srv
    assert srv.stop() == 0, srv.log_tail()


# Generous: on a slow, shared CI machine a request may wait long behind others; a timeout here
# is a lost request (a failure), never a measure of speed.
TIMEOUT = 300.0


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=TIMEOUT).text
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "{" in line
    }


def _wait_until(base: str, done, timeout: float = TIMEOUT) -> dict[str, float]:
    """Poll /metrics until ``done(metrics)``; return the last metrics (the caller asserts)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(base)
        if done(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def _idle(free_idle: float):
    return lambda m: (
        m["vllm:num_requests_running"] == 0
        and m["vllm:num_requests_waiting"] == 0
        and m["tpuserve:kv_cache_free_blocks"] == free_idle
    )


@pytest.mark.slow
def test_64_concurrent_streams_complete_without_lost_or_duplicated_tokens(server):
    n_clients, max_tokens = 64, 16
    client = openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT, http_client=None
    )

    async def one(i: int):
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Client {i} says:",
            max_tokens=max_tokens,
            temperature=0.7,
            seed=i,
            logprobs=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, n_tokens, finish, usage = "", 0, [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.text
                n_tokens += len(c.logprobs.tokens) if c.logprobs else 0
                if c.finish_reason:
                    finish.append(c.finish_reason)
        return text, n_tokens, finish, usage

    async def run_all():
        try:
            return await asyncio.gather(*(one(i) for i in range(n_clients)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    sync = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    for i, (text, n_tokens, finish, usage) in enumerate(results):
        assert finish == ["length"], (i, finish)
        assert n_tokens == max_tokens, (i, n_tokens)  # every position streamed exactly once
        assert usage.completion_tokens == max_tokens
        if i % 8 == 0:  # seeded sampling: the same request again, unstreamed, gives the same text
            again = sync.completions.create(
                model=MODEL,
                prompt=f"Client {i} says:",
                max_tokens=max_tokens,
                temperature=0.7,
                seed=i,
                extra_body={"ignore_eos": True},
            )
            assert again.choices[0].text == text, i


def test_disconnected_clients_free_their_kv_blocks(server):
    base = server.base_url
    idle = _metrics(base)
    free_idle = idle["tpuserve:kv_cache_free_blocks"]
    assert free_idle == idle["tpuserve:kv_cache_total_blocks"]
    max_tokens = 400
    n_streams, n_plain = 6, 2

    def body(i: int, stream: bool) -> dict:
        return {
            "model": MODEL,
            "prompt": f"Long story {i}:",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }

    async def stream_then_drop(c: httpx.AsyncClient, i: int) -> int:
        async with c.stream("POST", base + "/v1/completions", json=body(i, True)) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    return seen  # leaving the block closes the connection mid-stream
        return seen

    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            # Streams: each client leaves after its third event, whatever the machine's speed.
            seen = await asyncio.gather(*(stream_then_drop(c, i) for i in range(n_streams)))
            assert seen == [3] * n_streams
            # Non-streaming: leave once the server shows both requests generating (not after a
            # fixed time, which a slow machine might spend before they even start).
            plain = [
                asyncio.ensure_future(c.post(base + "/v1/completions", json=body(100 + i, False)))
                for i in range(n_plain)
            ]
            start = _metrics(base)["vllm:generation_tokens_total"]
            m = await asyncio.to_thread(
                _wait_until,
                base,
                lambda m: (
                    m["vllm:num_requests_running"] == n_plain
                    and m["vllm:generation_tokens_total"] >= start + n_plain
                ),
            )
            assert m["vllm:num_requests_running"] == n_plain, m
            assert not any(t.done() for t in plain)  # 400 tokens each: still generating
            for t in plain:
                t.cancel()  # the client goes away: the connection closes
            await asyncio.gather(*plain, return_exceptions=True)

    before = _metrics(base)["vllm:generation_tokens_total"]
    asyncio.run(run())
    m = _wait_until(base, _idle(free_idle))
    assert m["tpuserve:kv_cache_free_blocks"] == free_idle, m
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0, m
    # The requests were aborted, not run to their 8 x 400 tokens.
    assert m["vllm:generation_tokens_total"] - before < (n_streams + n_plain) * max_tokens / 2
    # And the server still serves.
    r = httpx.post(
        base + "/v1/completions",
        json={"model": MODEL, "prompt": "still there?", "max_tokens": 3},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

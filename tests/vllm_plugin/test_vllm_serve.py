"""``vllm serve <default model dir> --device tpu``: vLLM's OpenAI server over our runtime.

The opt-in is the command line alone (no environment variable). The official ``openai`` client
must get the same greedy completions, chat answers and streams as our standalone engine gives, and
a second request sharing a long prefix must report cached prompt tokens.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one
openai = pytest.importorskip("openai")

from vllm_helpers import SCAN_ARGS, child_env  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VLLM_CLI = os.path.join(os.path.dirname(sys.executable), "vllm")
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PREFIX = (
    "Background notes. The museum opens at nine in the morning and closes at six in the "
    "evening. Tickets cost twelve euros for adults and six for children. The east wing holds "
    "paintings from the seventeenth century, the west wing holds sculpture, and the basement "
    "holds old maps, clocks and scientific instruments. "
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(default_hf_dir, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
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
        "8",
        "--max-num-batched-tokens",
        "64",
        "--enable-prompt-tokens-details",
        "--served-model-name",
        "smollm2",
        *SCAN_ARGS,
    ]
    with open(log_path, "w") as log:
        # Its own session, so teardown can stop the server and the engine core it spawned.
        proc = subprocess.Popen(
            cmd, env=child_env(plugin=False), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
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
        yield SimpleServer(client, port, log_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class SimpleServer:
    def __init__(self, client, port, log_path):
        self.client, self.port, self.log_path = client, port, log_path

    def log(self) -> str:
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def ours():
    """Our standalone engine on the same default model: the expected greedy texts."""
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = LLM(None, max_model_len=512, layer_loop="scan")
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    return {
        "completion": llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text,
        "chat": llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0].text,
        "prefixed": llm.generate(PREFIX + "Question: When does it open?\nAnswer:", greedy, use_tqdm=False)[0]
        .outputs[0]
        .text,
    }


def test_log_says_the_plugin_is_active(server):
    log = server.log()
    assert "tpuserve vLLM platform active (--device tpu on the command line)" in log
    assert "tpuserve worker on JAX cpu" in log


def test_completion_matches_our_engine(server, ours):
    r = server.client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == ours["completion"]
    assert r.choices[0].text.startswith(" Paris")
    assert r.usage.completion_tokens == 16


def test_chat_matches_our_engine(server, ours):
    r = server.client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ours["chat"]
    assert "Paris" in r.choices[0].message.content


def test_streaming_completion_and_chat_concatenate_to_the_same_text(server, ours):
    stream = server.client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == ours["completion"]
    stream = server.client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=16, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == ours["chat"]


def test_shared_prefix_is_served_from_vllms_prefix_cache(server, ours):
    first = server.client.completions.create(
        model="smollm2",
        prompt=PREFIX + "Question: What does the east wing hold?\nAnswer:",
        max_tokens=4,
        temperature=0,
    )
    assert first.usage.prompt_tokens > 64
    second = server.client.completions.create(
        model="smollm2", prompt=PREFIX + "Question: When does it open?\nAnswer:", max_tokens=16, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 48, cached  # the shared prefix's full 16-token pages
    assert second.choices[0].text == ours["prefixed"]  # computed without any cache there
    import httpx

    metrics = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=30).text
    hits = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    ]
    assert hits and sum(hits) >= cached

"""/v1/completions and the small endpoints, driven with the official openai client against a real
``tpuserve serve`` process (tiny random-weight Qwen3 with the real Qwen3 tokenizer)."""

from __future__ import annotations

import httpx
import pytest
from server_fixtures import openai_client, running_server  # tests/server/server_fixtures.py

pytestmark = pytest.mark.timeout(300)

ENGINE_FLAGS = ["--max-model-len", "512", "--max-num-batched-tokens", "64", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def server(random_checkpoints, tmp_path_factory):
    yield from running_server(
        tmp_path_factory,
        "server",
        random_checkpoints["qwen3"],
        "--served-model-name",
        "tiny-qwen3",
        "--no-warmup",
        *ENGINE_FLAGS,
    )


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen3"]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]


def test_completion_text_and_usage(server, client):
    r = client.completions.create(model="tiny-qwen3", prompt="Hello there", max_tokens=7, **GREEDY)
    assert r.object == "text_completion" and r.model == "tiny-qwen3"
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == len(ids) + 7


def test_streamed_text_equals_non_streamed(client):
    kwargs = dict(model="tiny-qwen3", prompt="The quick brown fox", max_tokens=24, **GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 24
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].text
    assert finish == ["length"]


def test_server_greedy_matches_offline_llm(random_checkpoints, client):
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    prompts = ["Once upon a time", "def fibonacci(n):"]
    llm = LLM(
        random_checkpoints["qwen3"],
        max_model_len=512,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        warmup=False,
    )
    offline = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    for prompt, off in zip(prompts, offline):
        r = client.completions.create(model="tiny-qwen3", prompt=prompt, max_tokens=16, **GREEDY)
        assert r.choices[0].text == off.outputs[0].text


def test_n_choices(client):
    r = client.completions.create(
        model="tiny-qwen3",
        prompt="Pick a word:",
        max_tokens=5,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    assert len({c.text for c in r.choices}) > 1  # independent samples
    chunks = list(
        client.completions.create(
            model="tiny-qwen3",
            prompt="Pick a word:",
            max_tokens=5,
            n=2,
            stream=True,
            temperature=1.0,
            seed=7,
            extra_body={"ignore_eos": True},
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    # Seeded sampling: streamed choices equal the first two non-streamed ones.
    assert texts == {c.index: c.text for c in r.choices if c.index < 2}


def test_logprobs(client):
    r = client.completions.create(model="tiny-qwen3", prompt="Numbers:", max_tokens=6, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset)
    for _tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0.0
        assert 3 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert val == pytest.approx(max(top.values()), abs=1e-5)
    # Streaming carries the same logprobs, chunk by chunk.
    chunks = list(
        client.completions.create(
            model="tiny-qwen3", prompt="Numbers:", max_tokens=6, logprobs=3, stream=True, **GREEDY
        )
    )
    streamed = [
        v
        for c in chunks
        for v in (c.choices[0].logprobs.token_logprobs if c.choices and c.choices[0].logprobs else [])
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_stop_string(client):
    base = client.completions.create(
        model="tiny-qwen3", prompt="A story:", max_tokens=20, logprobs=0, **GREEDY
    )
    text = base.choices[0].text
    # A stop string taken from the middle of the greedy output: generation must end just before it.
    tokens = [t for t in base.choices[0].logprobs.tokens[4:] if t.strip() and "\ufffd" not in t]
    stop = tokens[0]
    expected = text[: text.find(stop)]
    for stream in (False, True):
        r = client.completions.create(
            model="tiny-qwen3", prompt="A story:", max_tokens=20, stop=[stop], stream=stream, **GREEDY
        )
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert got == expected and reason == "stop"


def test_seed_reproducibility(client):
    def sample(seed):
        return (
            client.completions.create(
                model="tiny-qwen3",
                prompt="Random:",
                max_tokens=12,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    a, b, c = sample(1234), sample(1234), sample(999)
    assert a == b
    assert a != c


def test_prompt_forms_and_echo(server, client):
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    by_text = client.completions.create(model="tiny-qwen3", prompt="Hello world", max_tokens=4, **GREEDY)
    by_ids = client.completions.create(model="tiny-qwen3", prompt=ids, max_tokens=4, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(
        model="tiny-qwen3", prompt=["Hello world", "Goodbye"], max_tokens=4, **GREEDY
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    batch_ids = client.completions.create(model="tiny-qwen3", prompt=[ids, ids], max_tokens=4, **GREEDY)
    assert [c.text for c in batch_ids.choices] == [by_text.choices[0].text] * 2
    echo = client.completions.create(
        model="tiny-qwen3", prompt="Hello world", max_tokens=4, echo=True, **GREEDY
    )
    assert echo.choices[0].text == "Hello world" + by_text.choices[0].text


def test_tokenize_detokenize_roundtrip(server):
    url = server.base_url
    tok = httpx.post(url + "/tokenize", json={"prompt": "Round trip, ok?"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    back = httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == "Round trip, ok?"
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_metrics(server, client):
    client.completions.create(model="tiny-qwen3", prompt="count me", max_tokens=3, **GREEDY)
    text = httpx.get(server.base_url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "{" in line
    }
    assert values["vllm:generation_tokens_total"] >= 3
    assert values["vllm:time_to_first_token_seconds_count"] >= 1
    assert values["vllm:num_requests_running"] == 0


def test_prefix_cache_usage_salt_and_metrics(server, client):
    """The openai client reads cached prompt tokens from usage; a cache_salt isolates them."""
    prompt = "The shared preamble of this prefix cache test. " * 12  # several full 16-token pages
    first = client.completions.create(model="tiny-qwen3", prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model="tiny-qwen3", prompt=prompt, max_tokens=2, **GREEDY)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
    assert again.choices[0].text == first.choices[0].text
    salted = client.completions.create(
        model="tiny-qwen3",
        prompt=prompt,
        max_tokens=2,
        temperature=0.0,
        extra_body={"cache_salt": "tenant-a"},
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model="tiny-qwen3", messages=chat, max_tokens=2, **GREEDY)
    c2 = client.chat.completions.create(model="tiny-qwen3", messages=chat, max_tokens=2, **GREEDY)
    assert c2.usage.prompt_tokens_details.cached_tokens > 0
    bad = httpx.post(
        server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": ""}
    )
    assert bad.status_code == 400 and "cache_salt" in bad.text
    text = httpx.get(server.base_url + "/metrics").text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "{" in line
    }
    assert values["vllm:prefix_cache_hits_total"] >= again.usage.prompt_tokens_details.cached_tokens
    assert values["vllm:prefix_cache_queries_total"] >= 3 * n

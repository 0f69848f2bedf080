"""SGLang's own launcher and HTTP server with the tpuserve platform: our executor under its scheduler.

One server for the module (start-up is the slow part: ~2 min on 2 busy cores). Every answer is
compared with our standalone engine on the same weights, greedy, token for token.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util

import pytest

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason='sglang is not installed here; run with "$(bash scripts/sglang_env.sh)"',
    ),
    pytest.mark.timeout(600),
]

MAX_NEW = 24
STORY = (
    "In a small village in the mountains, the villagers grow apples and pears, keep bees for "
    "honey, and sell what they make at the market in the town below every Saturday. "
)


def _generate(server, text: str, max_new: int = MAX_NEW, **extra) -> dict:
    import requests

    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new, **extra}}
    r = requests.post(server.url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def _reference(llm, texts: list[str], max_new: int = MAX_NEW):
    from tpuserve.server.sampling_params import SamplingParams

    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_new), use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]


def test_log_shows_platform_and_executor(sglang_server):
    log = sglang_server.log()
    assert "tpuserve SGLang platform active" in log  # the launcher resolved our platform
    assert "tpuserve platform active: building TpuServeTpModelWorker" in log  # the scheduler did
    assert "tpuserve executor active: SGLang scheduler -> TpuServeTpModelWorker" in log
    assert "tpuserve JAX executor ready" in log and "KV cache (30, 257, 16, 6, 64) in JAX" in log
    assert "decoder layers: scan" in log  # --model-loader-extra-config reached the executor


def test_no_torch_kv_pool_of_model_size(sglang_server):
    """SGLang's own accounting: no torch weights and no torch KV pool, yet 4096 token slots."""
    import requests

    info = requests.get(sglang_server.url + "/get_server_info", timeout=30).json()
    mem = info["internal_states"][0]["memory_usage"]
    assert mem["weight"] == 0 and mem["kvcache"] == 0, mem
    assert mem["token_capacity"] == 4096
    log = sglang_server.log()
    # SGLang logs "KV Cache is allocated ... KV size: X GB" whenever it builds a torch KV pool.
    assert "KV Cache is allocated" not in log
    assert "torch KV pool bytes: 0" in log


def test_generate_matches_standalone(sglang_server, reference_llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
    ref = _reference(reference_llm, prompts)
    for text, (prompt_ids, out_ids, out_text) in zip(prompts, ref):
        got = _generate(sglang_server, text)
        assert got["meta_info"]["prompt_tokens"] == len(prompt_ids)
        assert got["output_ids"] == out_ids, text
        assert got["text"] == out_text


def test_concurrent_requests_batch_and_match(sglang_server, reference_llm):
    """Continuous batching: requests in flight together still give each its own greedy answer."""
    prompts = [
        f"Write one sentence about {t}." for t in ("the sea", "mountains", "a cat", "rain", "music", "bread")
    ]
    ref = _reference(reference_llm, prompts, max_new=16)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _generate(sglang_server, p, max_new=16), prompts))
    assert [g["output_ids"] for g in got] == [r[1] for r in ref]


def test_chunked_prefill_long_prompt(sglang_server, reference_llm):
    """A prompt longer than SGLang's 256-token prefill chunk runs as several chunks."""
    text = STORY * 20 + "Summary:"
    ((prompt_ids, out_ids, _),) = _reference(reference_llm, [text], max_new=12)
    assert len(prompt_ids) > 2 * 256
    got = _generate(sglang_server, text, max_new=12)
    assert got["output_ids"] == out_ids


def test_prefix_cache_hit_gives_same_text(sglang_server, reference_llm):
    prefix = STORY * 4
    first, second = prefix + "Question: Where is the market?\nAnswer:", prefix + "The villagers"
    ((_, _, ref_text),) = _reference(reference_llm, [second])
    assert ref_text.strip(), "the reference answer should not be empty, or the check means little"
    _generate(sglang_server, first)
    got = _generate(sglang_server, second)
    assert got["meta_info"]["cached_tokens"] > 0, got["meta_info"]
    assert got["text"] == ref_text


def _chat_messages():
    return [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_openai_chat_matches_standalone(sglang_server, reference_llm):
    import openai

    from tpuserve.server.sampling_params import SamplingParams

    client = openai.OpenAI(base_url=sglang_server.url + "/v1", api_key="none")
    resp = client.chat.completions.create(
        model="default", messages=_chat_messages(), temperature=0, max_tokens=MAX_NEW
    )
    ref = reference_llm.chat(
        _chat_messages(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False
    )[0]
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_openai_chat_streaming(sglang_server):
    import openai

    client = openai.OpenAI(base_url=sglang_server.url + "/v1", api_key="none")
    whole = client.chat.completions.create(
        model="default", messages=_chat_messages(), temperature=0, max_tokens=MAX_NEW
    )
    stream = client.chat.completions.create(
        model="default", messages=_chat_messages(), temperature=0, max_tokens=MAX_NEW, stream=True
    )
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1, "streaming should deliver the answer in several chunks"
    assert "".join(pieces) == whole.choices[0].message.content


def test_openai_completions(sglang_server, reference_llm):
    import openai

    client = openai.OpenAI(base_url=sglang_server.url + "/v1", api_key="none")
    resp = client.completions.create(
        model="default", prompt="The capital of France is", temperature=0, max_tokens=MAX_NEW
    )
    ((_, _, ref_text),) = _reference(reference_llm, ["The capital of France is"])
    assert resp.choices[0].text == ref_text


def test_unsupported_features_refused_not_crashing(sglang_server):
    """Logprobs / structured output are not served yet: a 400 at admission, and the server lives on."""
    import openai
    import requests

    r = requests.post(
        sglang_server.url + "/generate",
        timeout=60,
        json={"text": "Hi", "return_logprob": True, "sampling_params": {"max_new_tokens": 4}},
    )
    assert r.status_code == 400 and "logprobs" in r.text
    client = openai.OpenAI(base_url=sglang_server.url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(
            model="default",
            messages=_chat_messages(),
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        )
    assert _generate(sglang_server, "The capital of France is", max_new=4)["text"]


def test_ngram_speculation_greedy_equals_standalone(hf_dir, reference_llm, tmp_path):
    """``--speculative-algorithm NGRAM``: SGLang's corpus drafts, our runner verifies (spec_ngram.py).
    Greedy answers equal our engine's without speculation, batched together with a sampled request;
    a repetitive prompt gets drafts accepted (several tokens a verify); a prefix-cache hit still
    answers the same; the server stays up and serves a plain request afterwards."""
    from conftest import launch_sglang

    fruits = "Here is a list of fruits: apples, pears, plums, " * 3
    prompts = [fruits, "The capital of France is", STORY * 2 + "The villagers"]
    ref = _reference(reference_llm, prompts)
    spec = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5")
    with launch_sglang(hf_dir, str(tmp_path / "server.log"), *spec) as server:
        with cf.ThreadPoolExecutor(len(prompts) + 1) as pool:
            sampled = pool.submit(_generate, server, fruits, temperature=0.8, ignore_eos=True)
            got = list(pool.map(lambda p: _generate(server, p), prompts))
            sampled = sampled.result()
        again = _generate(server, prompts[2])  # its prefix is in SGLang's radix cache now
        plain = _generate(server, "Once upon a time", max_new=4)
    assert [g["output_ids"] for g in got] == [r[1] for r in ref]
    assert again["output_ids"] == ref[2][1] and again["meta_info"]["cached_tokens"] > 0, again["meta_info"]
    assert len(sampled["output_ids"]) == MAX_NEW and plain["text"]
    meta = got[0]["meta_info"]
    # Every decode step was a verify, and drafts were accepted: fewer verifies than tokens.
    assert 0 < meta["spec_verify_ct"] < meta["completion_tokens"] - 1, meta
    assert meta["spec_num_correct_drafts"] > 0, meta

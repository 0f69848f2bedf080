"""Engine behaviour on a tiny random-weight Qwen3 with the real Qwen3 tokenizer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tpuserve.server.llm import LLM
from tpuserve.server.sampling_params import SamplingParams
from tpuserve.tpu_platform.config import ConfigError, EngineConfig

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def llm(random_checkpoints):
    return LLM(
        random_checkpoints["qwen3"],
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        num_gpu_blocks=80,
        warmup=False,
    )


def test_batch_with_bad_request_fails_alone(llm):
    too_long = "word " * 400
    outs = llm.generate(
        ["Hello there", too_long, {"prompt_token_ids": [10**9]}, "Goodbye"],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 5
    assert "max_model_len" in outs[1].error
    assert "vocabulary" in outs[2].error
    assert outs[3].error is None and len(outs[3].outputs[0].token_ids) == 5


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(min_p=2.0), "min_p"),
        (dict(top_k=-5), "top_k"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_config_errors_are_clear(random_checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig.from_kwargs(block_size=12)
    with pytest.raises(ConfigError, match="unknown engine argument"):
        EngineConfig.from_kwargs(max_num_seq=3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"), warmup=False)
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(random_checkpoints["qwen3"], max_model_len=10**6, warmup=False)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["GPTBigCodeForCausalLM"]}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(bad), warmup=False)


def test_seeded_sampling_reproduces_and_n_gives_distinct_samples(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, n=3, ignore_eos=True)
    a = llm.generate(["Once upon a time"], p, use_tqdm=False)[0]
    # Same request again, now sharing the batch with other work: same tokens.
    b = llm.generate(
        ["Once upon a time", "Other prompt"], [p, SamplingParams(temperature=0.7, seed=5)], use_tqdm=False
    )[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len(a.outputs) == 3 and len({tuple(o.token_ids) for o in a.outputs}) == 3


def test_stop_token_ids_max_tokens_and_min_tokens(llm):
    greedy = llm.generate(
        ["Count: one two three"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        use_tqdm=False,
    )[0]
    ids = greedy.outputs[0].token_ids
    stop_id = ids[5]
    first = ids.index(stop_id)
    out = llm.generate(
        ["Count: one two three"],
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.token_ids == ids[: first + 1]
    # min_tokens bans the stop id until enough tokens are out.
    out = llm.generate(
        ["Count: one two three"],
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id], min_tokens=first + 2),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) >= first + 2
    assert stop_id not in out.outputs[0].token_ids[: first + 2]


def test_stop_strings_cut_text(llm):
    greedy = llm.generate(
        ["Tell me"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    text = greedy.text
    assert len(text) > 6, text
    stop = text[3:6]
    idx = text.index(stop)
    out = llm.generate(
        ["Tell me"],
        SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:idx]
    out = llm.generate(
        ["Tell me"],
        SamplingParams(
            temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True, ignore_eos=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == text[: idx + len(stop)]


def test_logprobs_and_prompt_logprobs_are_consistent(llm):
    p = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate(["The sky is blue and the grass"], p, use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    total = 0.0
    for tok, pos in zip(c.token_ids, c.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top token
        assert len(pos) == 3  # the chosen token is also the top-1 entry
        total += pos[tok].logprob
        assert all(lp.logprob <= 0 for lp in pos.values())
    assert math.isclose(total, c.cumulative_logprob, rel_tol=1e-5, abs_tol=1e-5)
    pl = out.prompt_logprobs
    assert pl[0] is None and len(pl) == len(out.prompt_token_ids)
    for tok, pos in zip(out.prompt_token_ids[1:], pl[1:]):
        assert tok in pos and len(pos) in (2, 3)


def test_prompt_logprobs_match_full_logits(llm, random_checkpoints):
    """Prompt logprobs equal transformers' log_softmax at each position (independent oracle)."""
    import torch
    import transformers

    out = llm.generate(["A B C D E F G"], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        random_checkpoints["qwen3"], dtype=torch.float32
    ).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([out.prompt_token_ids])).logits[0], -1).numpy()
    for j, tok in enumerate(out.prompt_token_ids[1:]):
        np.testing.assert_allclose(out.prompt_logprobs[j + 1][tok].logprob, lp[j, tok], atol=1e-4)


def test_abort_frees_pages(llm):
    eng = llm.engine
    idle = eng.pool.num_free
    eng.add_request("a1", "Some long running request", SamplingParams(max_tokens=200, ignore_eos=True))
    eng.add_request("a2", "Another one", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.pool.num_free < idle
    out = eng.abort_request("a1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    eng.abort_request("a2")
    assert eng.pool.num_free == idle and not eng.has_unfinished_requests()


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_steady_state_compiles_nothing_new(random_checkpoints):
    """After warm-up no request mix compiles a program: random prompt lengths and batch sizes with
    greedy / temperature / top-p / top-k / min-p rows, logprobs of several k, prompt logprobs of
    several lengths, penalties, min_tokens (EOS held back) and a grammar."""
    from tpuserve.server.sampling_params import StructuredOutputParams

    llm = LLM(
        random_checkpoints["llama"],
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        num_gpu_blocks=40,
        warmup=False,
    )
    from jax import monitoring

    compiled = llm.engine.warmup()
    assert compiled >= len(llm.engine.runner.token_buckets) * len(llm.engine.runner.page_buckets)
    before = llm.engine.runner.compile_count
    # JAX's own count of XLA compilations: also catches eager ops our trace counters cannot see.
    backend_compiles = []

    def on_event(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            backend_compiles.append(secs)

    monitoring.register_event_duration_secs_listener(on_event)
    rng = np.random.default_rng(0)
    extras = [
        dict(),
        dict(logprobs=1),
        dict(logprobs=2),
        dict(logprobs=3),
        dict(logprobs=5),
        dict(logprobs=20),
        dict(prompt_logprobs=0),
        dict(prompt_logprobs=2),
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.5, frequency_penalty=0.2),
        dict(min_tokens=3, ignore_eos=False),
        dict(top_k=5),
        dict(min_p=0.1),
        dict(structured_outputs=StructuredOutputParams(regex="(yes|no)[a-z ]{0,20}")),
    ]
    for _round in range(6):
        n = int(rng.integers(1, 7))
        prompts = [
            {"prompt_token_ids": rng.integers(0, 1000, int(rng.integers(2, 60))).tolist()} for _ in range(n)
        ]
        params = []
        for _ in prompts:
            kw = dict(
                temperature=float(rng.choice([0.0, 0.8])),
                top_p=float(rng.choice([1.0, 0.9])),
                max_tokens=int(rng.integers(1, 40)),
                ignore_eos=True,
            )
            kw.update(extras[int(rng.integers(0, len(extras)))])
            params.append(SamplingParams(**kw))
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
    for kw in extras:  # every extra at least once, alone and in a full batch
        llm.generate(["Hello there"] * 4, SamplingParams(max_tokens=4, **kw), use_tqdm=False)
    monitoring.unregister_event_duration_listener(on_event)
    assert llm.engine.runner.compile_count == before
    assert backend_compiles == []


def test_async_scheduling_gives_the_same_outputs(random_checkpoints):
    """Overlapping step i+1's scheduling with step i's device work changes no token: greedy and
    seeded sampling, stops, min_tokens, n > 1, logprobs and penalties (held back to sync steps)."""
    kw = dict(max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks=40)
    sync = LLM(random_checkpoints["qwen3"], async_scheduling=False, **kw, warmup=False)
    overlapped = LLM(random_checkpoints["qwen3"], async_scheduling=True, **kw, warmup=False)
    prompts = ["Hello there", "The capital of France is", "1 2 3 4 5", "A B C D E F G H I J K L M"]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, n=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=4, logprobs=3),
        SamplingParams(temperature=0.8, seed=3, max_tokens=8, repetition_penalty=1.3, ignore_eos=True),
    ]
    a = sync.generate(prompts, params, use_tqdm=False)
    b = overlapped.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert [o.token_ids for o in x.outputs] == [o.token_ids for o in y.outputs]
        assert [o.finish_reason for o in x.outputs] == [o.finish_reason for o in y.outputs]
    assert [len(e) for e in a[2].outputs[0].logprobs] == [len(e) for e in b[2].outputs[0].logprobs]
    assert all(len(e) in (3, 4) for e in b[2].outputs[0].logprobs)  # top 3 (+ the chosen token)
    # A stop string found on the host ends the request even though the next step was already sent.
    text = a[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        x = sync.generate(
            ["Hello there"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False
        )[0].outputs[0]
        y = overlapped.generate(
            ["Hello there"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False
        )[0].outputs[0]
        assert (x.text, x.token_ids, x.finish_reason) == (y.text, y.token_ids, y.finish_reason)
    assert overlapped.engine.pool.num_free == sync.engine.pool.num_free  # nothing leaked


def test_async_scheduling_survives_preemption(random_checkpoints):
    """A pool too small for the batch forces preemption while tokens are still on the device."""
    kw = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks=13, block_size=16)
    prompts = [{"prompt_token_ids": list(range(10 + 7 * i, 40 + 7 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = {}
    for mode in (False, True):
        llm = LLM(random_checkpoints["llama"], async_scheduling=mode, **kw, warmup=False)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.pool.num_free == 12
    assert outs[True] == outs[False]
    assert all(len(t) == 40 for t in outs[True])


def test_generation_config_eos_list_ends_generation(llm, random_checkpoints, tmp_path):
    """A checkpoint's generation_config.json eos_token_id list ends generation as config.json's
    eos does (gpt-oss stops on <|call|> this way, Llama 3 instructs on <|eot_id|>). The stop
    token is whatever this random model greedily says third, so the run must end right there."""
    import json
    import os
    import shutil

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    said = llm.generate(["Hello there"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop = said[2]
    assert stop not in said[:2]
    path = str(tmp_path / "ckpt")
    shutil.copytree(random_checkpoints["qwen3"], path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [llm.get_tokenizer().eos_token_id, stop]}, f)
    other = LLM(
        path, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks=80, warmup=False
    )
    out = other.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == said[:3] and out.finish_reason == "stop"
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(Exception, match="generation_config.json: not valid JSON"):
        LLM(path, max_model_len=256, warmup=False)

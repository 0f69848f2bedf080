"""gpt-oss's chat through vLLM's own harmony path, on our platform.

For a ``gpt_oss`` model, ``vllm serve`` renders a chat request with openai_harmony (its own system
message, not the checkpoint's chat template) and reads the answer with its harmony parser; that
path needs o200k_base, which openai_harmony reads from ``TIKTOKEN_ENCODINGS_BASE`` (no hub here:
the tml-renderers wheel's copy). The checkpoint is tests/conftest.py's tiny random gpt-oss with
gpt-oss's tokenizer (201,088 ids). ``vllm serve --device tpu`` must render the conversation in
harmony (decoded by openai_harmony: the system turn, our developer instructions and user turn, the
open assistant turn), answer with our standalone engine's greedy tokens on those prompt ids, and
hand whatever the random model says to its parser without an error, whole and streamed.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")  # runs in the vLLM venv; test_vllm_venv_suite.py runs it from the main one
pytest.importorskip("openai")
pytest.importorskip("openai_harmony")
pytest.importorskip("tml_renderers")

from vllm_helpers import root_conftest
from vllm_server import vllm_servers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 12
PAGES = 64
ENGINE = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, block_size=16)
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> str:
    return root_conftest().build_harmony_gpt_oss(str(tmp_path_factory.mktemp("vllm-harmony")))


@pytest.fixture(scope="module")
def enc():
    return root_conftest().harmony_encoding()


def _ours(path: str, prompt_ids: list[int]) -> list[int]:
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = LLM(path, dtype="float32", num_gpu_blocks=PAGES, warmup=False, **ENGINE)
    out = llm.generate(
        [{"prompt_token_ids": prompt_ids}],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return list(out[0].outputs[0].token_ids)


def test_vllm_chat_renders_gpt_oss_in_harmony_and_answers_with_our_tokens(gpt_oss_dir, enc, tmp_path):
    vocab_dir = os.path.dirname(root_conftest().o200k_vocab_file())
    args = [gpt_oss_dir, "--dtype", "float32", "--seed", "0", "--num-gpu-blocks-override", str(PAGES)]
    for key, value in ENGINE.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    request = dict(
        model="m",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    with vllm_servers([(args, tmp_path / "serve.log", {"TIKTOKEN_ENCODINGS_BASE": vocab_dir})]) as (srv,):
        whole = srv.client.chat.completions.create(**request)
        chunks = list(srv.client.chat.completions.create(**request, stream=True))
        log = srv.log(tail=200_000)
    assert "tpuserve vLLM platform active (--device tpu on the command line)" in log, log[-3000:]
    prompt_ids, tokens = whole.model_extra["prompt_token_ids"], whole.choices[0].model_extra["token_ids"]
    text = enc.decode(prompt_ids)
    # vLLM's harmony rendering: its own system turn first, the request's system message as
    # developer instructions, the user turn, then the assistant turn left open for the model.
    assert text.startswith("<|start|>system<|message|>"), text
    assert "<|start|>developer<|message|>" in text and "Answer briefly." in text, text
    assert "<|start|>user<|message|>What is 2+2?<|end|>" in text, text
    assert text.endswith("<|start|>assistant"), text
    # The prompt ids are openai_harmony's own encoding of that text, token for token.
    assert enc.encode(text, allowed_special="all") == prompt_ids
    assert tokens == _ours(gpt_oss_dir, prompt_ids), "vllm serve (harmony chat) vs our engine"
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == MAX_TOKENS
    # Streamed, the same request goes through the same parser without an error, chunk by chunk.
    assert chunks and chunks[-1].choices[0].finish_reason == "length", chunks[-1]

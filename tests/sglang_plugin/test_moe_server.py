"""Mixture-of-experts models through SGLang with the tpuserve platform.

The main suite's tiny MoE checkpoints (tests/vllm_plugin/moe_checkpoints.py builds them with
tests/tpu_platform's builders): Qwen3-MoE, gpt-oss with f32 experts, gpt-oss with its experts as the
published MXFP4 blocks/scales (with the default model's tokenizer: this venv has not the main
suite's tokenizer packages). All three go through SGLang's argument resolution as its launcher
runs it (plugins, parse, resolve, ModelConfig), in one child process: accepted with our attention
backend, the checkpoint's own format, and our dtype. A real ``python -m sglang.launch_server``
serves each of the three (gpt-oss's sliding-window and full layers, attention sinks, MXFP4 or f32
experts; Qwen3-MoE's routed experts; all in our JAX executor), and its greedy tokens must equal
our standalone engine's on the same prompt ids, a prompt past SGLang's prefill chunk and a second
request hitting SGLang's radix cache included; gpt-oss with float experts runs with SGLang's n-gram
speculation on. SGLang's chat endpoint renders a gpt-oss conversation
through the checkpoint's (harmony) chat template as openai_harmony does.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from conftest import launch_sglang, resolve_server_args

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason='sglang is not installed here; run with "$(bash scripts/sglang_env.sh)"',
    ),
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_NEW = 12
CHUNK = 16  # SGLang's --chunked-prefill-size here: the long prompt below spans several chunks
PREFIX = (
    "Background notes. The museum opens at nine in the morning and closes at six in the "
    "evening. Tickets cost twelve euros for adults and six for children. The east wing holds "
    "paintings from the seventeenth century. "
)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    PREFIX + "Question: When does the museum open?\nAnswer:",
    PREFIX + "Question: What is in the east wing?\nAnswer:",
]


def _moe_checkpoints():
    """tests/vllm_plugin/moe_checkpoints.py (one builder for both plugin suites), by path."""
    name = "tpuserve_tests_moe_checkpoints"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(HERE), "vllm_plugin", "moe_checkpoints.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    # the default model's tokenizer: this venv lacks the main suite's tokenizer packages
    return _moe_checkpoints().build_all(str(tmp_path_factory.mktemp("sglang-moe")), tokenizer="default")


def test_moe_models_resolve_on_our_platform(checkpoints):
    cases = {
        "qwen3_moe": (checkpoints["qwen3_moe"], []),
        "gpt_oss": (checkpoints["gpt_oss"], []),
        "gpt_oss_mxfp4": (checkpoints["gpt_oss_mxfp4"], []),
        "gpt_oss_mxfp4_flag": (checkpoints["gpt_oss_mxfp4"], ["--quantization", "mxfp4"]),
        "qwen3_moe_fp8": (checkpoints["qwen3_moe"], ["--quantization", "fp8"]),
    }
    res = resolve_server_args(cases)
    for name, quant in (("qwen3_moe", None), ("gpt_oss", None), ("gpt_oss_mxfp4", "mxfp4")):
        r = res[name]
        assert "error" not in r, (name, r)
        assert r["attention_backend"] == "tpuserve" and r["quantization"] == quant, (name, r)
        assert r["dtype"] == "auto", (name, r)  # ours to resolve (f32 on CPU), not a kernel's bf16
    assert res["gpt_oss_mxfp4_flag"]["quantization"] == "mxfp4", res["gpt_oss_mxfp4_flag"]
    err = res["qwen3_moe_fp8"]["error"]
    assert "--quantization fp8 with a mixture-of-experts model (Qwen3MoeForCausalLM)" in err, err


def _reference(path: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    from tpuserve.server.llm import LLM
    from tpuserve.server.sampling_params import SamplingParams

    llm = LLM(path, dtype="float32", warmup=False, max_num_batched_tokens=CHUNK)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


# gpt-oss with float experts is also served with SGLang's n-gram speculation (spec_ngram.py): its
# greedy tokens must not change (every decode step is then a verify of SGLang's drafts).
SPECULATE = {"gpt_oss": ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4")}


@pytest.mark.parametrize("kind", ["gpt_oss_mxfp4", "gpt_oss", "qwen3_moe"])
def test_moe_served_greedy_equals_standalone(kind, checkpoints, tmp_path):
    import requests

    path = checkpoints[kind]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    assert len(prompt_ids[2]) > 2 * CHUNK
    spec = SPECULATE.get(kind, ())
    with launch_sglang(
        path, str(tmp_path / "server.log"), "--chunked-prefill-size", str(CHUNK), *spec
    ) as server:
        got = []
        for ids in prompt_ids:  # one at a time: the last one finds the previous one's prefix cached
            body = {
                "input_ids": ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
            }
            r = requests.post(server.url + "/generate", json=body, timeout=300)
            r.raise_for_status()
            got.append(r.json())
        log = server.log()
    # our executor kept gpt-oss's published experts as MXFP4 records, and the float ones as floats
    assert f"weights={'mxfp4' if kind == 'gpt_oss_mxfp4' else 'dense'}," in log, log[-4000:]
    assert got[-1]["meta_info"]["cached_tokens"] >= 2 * 16, got[-1]["meta_info"]  # radix cache hit
    ref = _reference(path, prompt_ids)
    assert [g["output_ids"] for g in got] == ref
    if spec:
        assert all(g["meta_info"].get("spec_verify_ct", 0) > 0 for g in got), [g["meta_info"] for g in got]


def test_gpt_oss_chat_renders_through_the_checkpoints_template(tmp_path):
    """SGLang's chat endpoint on a gpt-oss checkpoint with gpt-oss's tokenizer and a harmony chat
    template (tests/conftest.py's): the prompt SGLang renders through the tokenizer's template is
    the one openai_harmony renders (reasoning_effort included), its gpt-oss reasoning parser takes
    the output, and the tokens are our engine's greedy tokens for that prompt."""
    import requests

    oh = pytest.importorskip("openai_harmony")
    root = _moe_checkpoints().root_conftest()
    path = root.build_harmony_gpt_oss(str(tmp_path / "gpt_oss_harmony"))
    effort = oh.ReasoningEffort.HIGH
    want = root.harmony_encoding().render_conversation_for_completion(
        oh.Conversation.from_messages(
            [
                oh.Message.from_role_and_content(
                    oh.Role.SYSTEM, oh.SystemContent.new().with_reasoning_effort(effort)
                ),
                oh.Message.from_role_and_content(
                    oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions("Answer briefly.")
                ),
                oh.Message.from_role_and_content(oh.Role.USER, "What is 2+2?"),
            ]
        ),
        oh.Role.ASSISTANT,
    )
    body = {
        "model": path,
        "messages": [
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "reasoning_effort": "high",
        "temperature": 0,
        "max_tokens": MAX_NEW,
        "ignore_eos": True,
        "return_prompt_token_ids": True,
        "return_token_ids": True,
    }
    with launch_sglang(path, str(tmp_path / "server.log"), "--reasoning-parser", "gpt-oss") as server:
        r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == want
    assert choice["response_token_ids"] == _reference(path, [want])[0]

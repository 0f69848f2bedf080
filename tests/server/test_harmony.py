"""gpt-oss's harmony format in the chat API, against openai_harmony (OpenAI's own renderer and parser).

The tokenizer is gpt-oss's (o200k_base + the harmony special tokens, conftest.harmony_tokenizer);
its chat template is one written for these tests (tests/server/data/harmony_chat_template.jinja)
and held to openai_harmony's rendering first. Then the chat handler, with a scripted engine in
place of the model: the prompt ids it submits for API requests (reasoning_effort, a developer
message, tools, a past turn's reasoning and tool calls) must be openai_harmony's, and harmony
output tokens rendered by openai_harmony must come back as the reasoning, content and tool calls
that openai_harmony's own parser reads from them, whole and streamed.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from conftest import build_harmony_gpt_oss, harmony_encoding, harmony_tokenizer

oh = pytest.importorskip("openai_harmony")

pytestmark = pytest.mark.timeout(300)

# Multi-byte text (accents, CJK, an emoji split over several tokens) in every part that streams.
REASONING = "The user asks about the weather in Zürich; 天气 means weather. 🌦️ I should call the tool."
ANSWER = "It is 20 °C in Zürich — 晴れ. 🌞"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Gets the weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city name"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                    "days": {"type": "integer"},
                    "hourly": {"type": "boolean", "description": "One value an hour"},
                    "fields": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The current time."}},
]


@pytest.fixture(scope="module")
def tok():
    return harmony_tokenizer()


@pytest.fixture(scope="module")
def enc():
    return harmony_encoding()


# ---- the test tokenizer and template against openai_harmony ----


def test_tokenizer_is_openai_harmonys(tok, enc):
    assert len(tok) == 201088
    text = "Hello, wörld! 2024 → 東京 🌦️\n\n  x<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final"
    assert tok.encode(text, add_special_tokens=False) == enc.encode(text, allowed_special="all")
    ids = enc.encode("<|return|><|call|><|constrain|>", allowed_special="all")
    assert tok.convert_ids_to_tokens(ids) == ["<|return|>", "<|call|>", "<|constrain|>"]


def _harmony_tools():
    out = []
    for t in TOOLS:
        f = t["function"]
        out.append(oh.ToolDescription.new(f["name"], f["description"], parameters=f.get("parameters")))
    return out


def _system(effort: str = "medium"):
    content = oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort(effort.capitalize()))
    return oh.Message.from_role_and_content(oh.Role.SYSTEM, content)


def _assistant(text: str, channel: str, to: str | None = None):
    m = oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel(channel)
    if to is not None:
        m = m.with_recipient(to).with_content_type("<|constrain|>json")
    return m


def _tool_result(name: str, text: str):
    author = oh.Author.new(oh.Role.TOOL, f"functions.{name}")
    return (
        oh.Message.from_author_and_content(author, text)
        .with_channel("commentary")
        .with_recipient("assistant")
    )


ARGS = {"city": "Zürich", "unit": "c"}
CASES = {
    # name: (chat API request fields, openai_harmony's messages for the same conversation)
    "system_and_effort": (
        dict(
            messages=[
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is 2+2?"},
            ],
            reasoning_effort="high",
        ),
        lambda: [
            _system("high"),
            oh.Message.from_role_and_content(
                oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions("Answer briefly.")
            ),
            oh.Message.from_role_and_content(oh.Role.USER, "What is 2+2?"),
        ],
    ),
    "developer_and_tools": (
        dict(
            messages=[
                {"role": "developer", "content": "Use the tools."},
                {"role": "user", "content": "Weather in Zürich?"},
            ],
            tools=TOOLS,
            reasoning_effort="low",
        ),
        lambda: [
            _system("low"),
            oh.Message.from_role_and_content(
                oh.Role.DEVELOPER,
                oh.DeveloperContent.new()
                .with_instructions("Use the tools.")
                .with_function_tools(_harmony_tools()),
            ),
            oh.Message.from_role_and_content(oh.Role.USER, "Weather in Zürich?"),
        ],
    ),
    # The turn in progress: its reasoning and tool call, the tool's answer; the reasoning stays.
    "reasoning_call_and_result": (
        dict(
            messages=[
                {"role": "user", "content": "Weather in Zürich?"},
                {
                    "role": "assistant",
                    "reasoning": REASONING,
                    "content": "Let me look.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
            ],
            tools=TOOLS,
        ),
        lambda: [
            _system(),
            oh.Message.from_role_and_content(
                oh.Role.DEVELOPER, oh.DeveloperContent.new().with_function_tools(_harmony_tools())
            ),
            oh.Message.from_role_and_content(oh.Role.USER, "Weather in Zürich?"),
            _assistant(REASONING, "analysis"),
            _assistant("Let me look.", "commentary"),
            _assistant(json.dumps(ARGS, ensure_ascii=False), "commentary", to="functions.get_weather"),
            _tool_result("get_weather", '{"temp": 20}'),
        ],
    ),
    # A finished turn's reasoning is dropped from the next prompt (SGLang's / vLLM's name for it).
    "past_reasoning_dropped": (
        dict(
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "reasoning_content": "A greeting.", "content": ANSWER},
                {"role": "user", "content": "Thanks"},
            ]
        ),
        lambda: [
            _system(),
            oh.Message.from_role_and_content(oh.Role.USER, "Hi"),
            _assistant("A greeting.", "analysis"),
            _assistant(ANSWER, "final"),
            oh.Message.from_role_and_content(oh.Role.USER, "Thanks"),
        ],
    ),
}


class _ScriptedEngine:
    """Stands in for the engine behind ServingContext.submit: records the prompt ids it is given
    and streams ``script`` (generated token ids) back, ``step`` tokens per output."""

    def __init__(self, script: list[int], step: int = 1):
        self.script, self.step, self.prompts = script, step, []

    async def submit(self, items, cache_salt=None, kv_transfer_params=None):
        ((request_id, _, prompt_ids, params),) = items
        self.prompts.append(list(prompt_ids))
        return [self._stream(request_id, prompt_ids, params)]

    async def _stream(self, request_id, prompt_ids, params):
        from tpuserve.server.outputs import CompletionOutput, RequestOutput

        ids = self.script[: params.max_tokens]
        for end in [*range(self.step, len(ids), self.step), len(ids)]:
            last = end == len(ids)
            finish = None if not last else ("stop" if len(ids) < params.max_tokens else "length")
            out = CompletionOutput(index=0, text="", token_ids=ids[:end], finish_reason=finish)
            yield RequestOutput(request_id, None, list(prompt_ids), [out], finished=last)


def _handler(tok, engine: _ScriptedEngine):
    from tpuserve.server.serving_chat import ChatHandler
    from tpuserve.server.serving_common import ServingContext

    core = SimpleNamespace(tokenizer=tok, vocab_size=len(tok), max_model_len=4096, engine=SimpleNamespace())
    ctx = ServingContext(engine=core, model_name="m", model_root="m")
    ctx.submit = engine.submit  # type: ignore[method-assign]
    return ChatHandler(ctx), ctx


def _create(tok, script: list[int], step: int = 1, **request):
    """Run one chat request through the real handler; -> (engine, response or chunk dicts)."""
    from tpuserve.server.protocol import ChatCompletionRequest
    from tpuserve.server.serving_common import StreamingResult

    engine = _ScriptedEngine(script, step)
    handler, ctx = _handler(tok, engine)
    req = ChatCompletionRequest(model="m", max_tokens=request.pop("max_tokens", 256), **request)

    async def run():
        result = await handler.create(req)
        if isinstance(result, StreamingResult):
            events = [e async for e in result.events]
            return [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        return result.model_dump()

    try:
        return engine, asyncio.run(run())
    finally:
        ctx.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_prompts_render_as_openai_harmony_renders_them(tok, enc, case):
    request, messages = CASES[case]
    engine, _ = _create(tok, [], **request)
    want = enc.render_conversation_for_completion(
        oh.Conversation.from_messages(messages()), oh.Role.ASSISTANT
    )
    assert engine.prompts == [want], enc.decode_utf8(engine.prompts[0]) + "\n!=\n" + enc.decode_utf8(want)


# ---- output: openai_harmony's messages -> what the API returns ----


def _completion(enc, messages, last_stop: str = "<|return|>") -> list[int]:
    """Generated ids for ``messages`` after the prompt's ``<|start|>assistant``, ending on
    ``last_stop`` as a sampled completion does."""
    ids: list[int] = []
    for m in messages:
        ids += enc.render(m)
    head = enc.encode("<|start|>assistant", allowed_special="all")
    assert ids[: len(head)] == head
    ids = ids[len(head) :]
    if ids[-1] == enc.encode("<|end|>", allowed_special="all")[0]:
        ids[-1] = enc.encode(last_stop, allowed_special="all")[0]
    return ids


def _oracle(enc, ids: list[int]) -> dict:
    """What openai_harmony's parser reads from ``ids``, mapped to the chat API."""
    parsed = enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT)
    out = {"reasoning": "", "content": "", "calls": []}
    for m in parsed:
        text = "".join(c.text for c in m.content)
        if m.recipient and m.recipient.startswith("functions."):
            out["calls"].append((m.recipient[len("functions.") :], text))
        elif m.channel == "analysis":
            out["reasoning"] += text
        else:
            out["content"] += text
    return out


OUTPUTS = {
    "reasoning_then_answer": lambda: [_assistant(REASONING, "analysis"), _assistant(ANSWER, "final")],
    "reasoning_preamble_and_call": lambda: [
        _assistant(REASONING, "analysis"),
        _assistant("Checking 東京.", "commentary"),
        _assistant(json.dumps(ARGS, ensure_ascii=False), "commentary", to="functions.get_weather"),
    ],
    "two_calls": lambda: [
        _assistant('{"city": "Paris"}', "commentary", to="functions.get_weather"),
        _assistant("{}", "commentary", to="functions.now"),
    ],
}


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_harmony_output_becomes_reasoning_content_and_calls(tok, enc, case):
    messages = OUTPUTS[case]()
    calls_end = messages[-1].recipient is not None
    ids = _completion(enc, messages, "<|call|>" if calls_end else "<|return|>")
    want = _oracle(enc, ids)
    assert want["reasoning"] or want["calls"]  # the oracle read structure, not plain text

    # the parser alone, whole and fed in uneven pieces
    from tpuserve.server.harmony import HarmonyParser, HarmonyTokens, parse_harmony

    tokens = HarmonyTokens.of(tok)
    assert tokens is not None
    whole = parse_harmony(tok, tokens, ids)
    got = {
        "reasoning": whole.reasoning,
        "content": whole.content,
        "calls": [(c.name, c.arguments) for c in whole.calls],
    }
    assert got == want
    for step in (1, 2, 5):
        parser = HarmonyParser(tok, tokens)
        pieces = [parser.feed(ids[i : i + step]) for i in range(0, len(ids), step)] + [parser.flush()]
        assert "".join(p.reasoning for p in pieces) == want["reasoning"]
        assert "".join(p.content for p in pieces) == want["content"]
        assert [(c.name, c.arguments) for p in pieces for c in p.calls] == want["calls"]

    # through the chat handler: one response, and a stream
    request = dict(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)
    _, resp = _create(tok, ids, **request)
    choice = resp["choices"][0]
    msg = choice["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == (want["reasoning"] or None)
    assert msg["content"] == (want["content"] or None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == want["calls"]
    assert choice["finish_reason"] == ("tool_calls" if want["calls"] else "stop")

    _, chunks = _create(tok, ids, step=3, stream=True, **request)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == want["reasoning"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == want["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == want["content"]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == want["calls"]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert chunks[-1]["choices"][0]["finish_reason"] == ("tool_calls" if want["calls"] else "stop")
    # the reasoning streams as it is generated: more than one delta carries it
    assert not want["reasoning"] or sum(1 for d in deltas if d.get("reasoning")) > 1


def test_include_reasoning_false_and_no_tools(tok, enc):
    ids = _completion(enc, OUTPUTS["reasoning_preamble_and_call"]())
    _, resp = _create(tok, ids, messages=[{"role": "user", "content": "Weather?"}], include_reasoning=False)
    msg = resp["choices"][0]["message"]
    # No reasoning asked for; no tools in the request, so the call's arguments stay in the content.
    assert msg["reasoning"] is None and msg["tool_calls"] == []
    assert msg["content"] == "Checking 東京." + json.dumps(ARGS, ensure_ascii=False)


def test_cut_short_and_non_harmony_output_lose_no_text(tok, enc):
    from tpuserve.server.harmony import HarmonyTokens, parse_harmony

    tokens = HarmonyTokens.of(tok)
    full = _completion(enc, [_assistant(REASONING, "analysis"), _assistant(ANSWER, "final")])
    # max_tokens ends the answer mid-way: what was generated of it is the content so far
    cut = full[:-4]
    got = parse_harmony(tok, tokens, cut)
    assert got.reasoning == REASONING and ANSWER.startswith(got.content.rstrip("\ufffd")) and got.content
    # a call cut inside its arguments is not a call; its text is kept
    call = _completion(
        enc, [_assistant(json.dumps(ARGS), "commentary", to="functions.get_weather")], "<|call|>"
    )
    got = parse_harmony(tok, tokens, call[:-3])
    assert not got.calls and got.content and json.dumps(ARGS).startswith(got.content)
    # output with no harmony marker at all (a model that ignores the format) is all content
    plain = tok.encode("Just text, 東京.", add_special_tokens=False)
    assert parse_harmony(tok, tokens, plain).content == "Just text, 東京."
    # a tokenizer without the harmony tokens does not switch the parser on
    from conftest import real_tokenizer

    assert HarmonyTokens.of(real_tokenizer("qwen3")) is None


# ---- a gpt-oss checkpoint served by `tpuserve serve` ----


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, tok):
    return build_harmony_gpt_oss(str(tmp_path_factory.mktemp("gpt-oss-harmony")), tok)


@pytest.mark.slow
def test_served_gpt_oss_renders_harmony(tmp_path_factory, gpt_oss_dir, enc):
    """`tpuserve serve` on the gpt-oss directory: the checkpoint's template renders the request as
    openai_harmony does, and the harmony reader takes whatever a random model says, whole or
    streamed, without an error."""
    from server_fixtures import openai_client, running_server

    gen = running_server(
        tmp_path_factory,
        "harmony-server",
        gpt_oss_dir,
        "--no-warmup",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
    )
    srv = next(gen)
    try:
        client = openai_client(srv)
        request, messages = CASES["developer_and_tools"]
        want = enc.render_conversation_for_completion(
            oh.Conversation.from_messages(messages()), oh.Role.ASSISTANT
        )
        for stream in (False, True):
            out = client.chat.completions.create(
                model=gpt_oss_dir,
                max_tokens=24,
                temperature=1.0,
                seed=1,
                stream=stream,
                stream_options={"include_usage": True} if stream else None,
                extra_body={"ignore_eos": True},
                **request,
            )
            if stream:
                chunks = list(out)
                assert chunks[-2].choices[0].finish_reason in ("length", "tool_calls")
                usage = chunks[-1].usage
            else:
                assert out.choices[0].finish_reason in ("length", "tool_calls")
                usage = out.usage
            assert usage.prompt_tokens == len(want) and usage.completion_tokens == 24
    finally:
        next(gen, None)

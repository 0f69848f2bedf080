"""Fast unit tests of the API's pieces (no server process): tool-call parsing, grammar matchers,
request validation and error shapes, the async engine's queue bound and abort."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import numpy as np
import pytest

from tpuserve.server.tool_parser import StreamingToolParser, parse_tool_calls

pytestmark = pytest.mark.timeout(300)


# ---- tool calls ----

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(
    "text, content, names",
    [
        ("just text", "just text", []),
        (CALL, None, ["get_weather"]),
        ("Let me check.\n" + CALL, "Let me check.", ["get_weather"]),
        (CALL + "\n" + CALL.replace("Paris", "Oslo"), None, ["get_weather", "get_weather"]),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ('<tool_call>{"name": "f", "arguments": {}}', None, ["f"]),  # unclosed but complete JSON
        ("a < b <tool", "a < b <tool", []),
    ],
)
def test_parse_tool_calls(text, content, names):
    got_content, calls = parse_tool_calls(text)
    assert got_content == content
    assert [c.name for c in calls] == names
    for c in calls:
        assert isinstance(json.loads(c.arguments), dict) and c.id.startswith("call_")


@pytest.mark.parametrize(
    "text",
    [
        "plain answer without calls",
        CALL,
        "Sure: " + CALL,
        CALL + CALL,
        "x <tool_c y",
        "<tool_call>{broken</tool_call> tail",
        '<tool_call>{"name": "f", "arguments": {"a": 1}}',
    ],
)
def test_streaming_parser_agrees_with_whole_text_parser(text):
    rng = random.Random(0)
    for _ in range(20):
        parser = StreamingToolParser()
        content, calls = "", []
        i = 0
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 7))
            d = parser.feed(text[i:j])
            content += d.content
            calls += d.calls or []
            i = j
        tail = parser.flush()
        content += tail.content
        calls += tail.calls or []
        whole_content, whole_calls = parse_tool_calls(text)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
        if not whole_calls:
            assert content == text
        else:
            assert content.strip() == (whole_content or "")


# ---- grammars ----


@pytest.fixture(scope="module")
def tokenizer():
    from conftest import real_tokenizer

    return real_tokenizer("qwen3")


def _allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def _greedy_walk(matcher, tokenizer, vocab, limit=200) -> str:
    """Follow the grammar taking the allowed token that decodes longest (a deterministic walk)."""
    ids = []
    for _ in range(limit):
        if matcher.is_terminated():
            break
        allowed = _allowed(matcher.fill_bitmask(), vocab)
        assert len(allowed) > 0
        tok = (
            int(allowed[0])
            if len(allowed) == 1
            else int(max(allowed[:5000], key=lambda t: (len(tokenizer.decode([int(t)])), -int(t))))
        )
        if tok == tokenizer.convert_tokens_to_ids("<|im_end|>") or matcher.is_terminated():
            assert matcher.accept(tok)
            break
        assert matcher.accept(tok)
        ids.append(tok)
    return tokenizer.decode(ids)


def test_regex_and_choice_matchers(tokenizer):
    from tpuserve.server.sampling_params import StructuredOutputParams
    from tpuserve.server.structured_output import bitmask_words, choice_regex, make_grammar_matcher

    vocab = len(tokenizer) + 7  # a padded model vocabulary: ids past the tokenizer stay masked
    m = make_grammar_matcher(StructuredOutputParams(regex=choice_regex(["yes", "no"])), tokenizer, vocab)
    mask = m.fill_bitmask()
    assert mask.dtype == np.int32 and mask.shape == (bitmask_words(vocab),)
    allowed = _allowed(mask, vocab)
    assert all(t < len(tokenizer) for t in allowed)
    assert {tokenizer.decode([int(t)]) for t in allowed} <= {"y", "ye", "yes", "n", "no"}
    text = _greedy_walk(m, tokenizer, vocab)
    assert text in ("yes", "no")


def test_json_schema_matcher_produces_valid_json(tokenizer):
    from tpuserve.server.sampling_params import StructuredOutputParams
    from tpuserve.server.structured_output import make_grammar_matcher

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "tag": {"type": "string", "enum": ["a", "b"]}},
        "required": ["ok", "tag"],
        "additionalProperties": False,
    }
    m = make_grammar_matcher(StructuredOutputParams(json=schema), tokenizer, len(tokenizer))
    obj = json.loads(_greedy_walk(m, tokenizer, len(tokenizer)))
    assert set(obj) == {"ok", "tag"} and obj["tag"] in ("a", "b")


@pytest.mark.parametrize(
    "so, field",
    [
        ({"regex": "("}, "regex"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"json": {"type": 5}}, "json"),
    ],
)
def test_bad_grammars_raise_value_error_naming_the_field(tokenizer, so, field):
    from tpuserve.server.sampling_params import StructuredOutputParams
    from tpuserve.server.structured_output import make_grammar_matcher

    with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
        make_grammar_matcher(StructuredOutputParams(**so), tokenizer, len(tokenizer))


def test_tool_call_grammar_forces_a_parseable_call(tokenizer):
    from tpuserve.server.sampling_params import StructuredOutputParams
    from tpuserve.server.structured_output import make_grammar_matcher, tool_call_grammar

    grammar = tool_call_grammar(
        [
            {
                "name": "lookup",
                "parameters": {
                    "type": "object",
                    "properties": {"q": {"type": "string", "enum": ["x", "y"]}},
                    "required": ["q"],
                    "additionalProperties": False,
                },
            }
        ]
    )
    m = make_grammar_matcher(StructuredOutputParams(grammar=grammar), tokenizer, len(tokenizer))
    text = _greedy_walk(m, tokenizer, len(tokenizer))
    content, calls = parse_tool_calls(text)
    assert content is None and [c.name for c in calls] == ["lookup"]
    assert json.loads(calls[0].arguments)["q"] in ("x", "y")


# ---- request models and errors ----


def test_request_models_ignore_unknown_fields_and_bound_numbers():
    from pydantic import ValidationError

    from tpuserve.server.protocol import ChatCompletionRequest, CompletionRequest

    r = CompletionRequest(prompt="hi", some_future_field=1, top_k=5)
    assert r.max_tokens == 16 and r.n == 1 and r.top_k == 5
    assert not hasattr(r, "some_future_field")
    for bad in ({"n": 0}, {"n": 10**6}, {"temperature": float("nan")}, {"top_p": float("inf")}):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="hi", **bad)
    c = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    assert c.max_tokens is None and c.logprobs is False


def test_sampling_params_mapping_and_errors():
    from tpuserve.server.api_errors import APIError
    from tpuserve.server.protocol import CompletionRequest
    from tpuserve.server.serving_common import (
        make_sampling_params,
        resolve_max_tokens,
        structured_from_request,
    )

    req = CompletionRequest(
        prompt="hi", temperature=0, stop="END", top_k=-1, seed=3, repetition_penalty=1.1, ignore_eos=True
    )
    p = make_sampling_params(req, max_tokens=5, logprobs=2)
    assert (p.temperature, p.stop, p.top_k, p.seed, p.max_tokens, p.logprobs) == (0, ["END"], 0, 3, 5, 2)
    assert p.repetition_penalty == pytest.approx(1.1) and p.ignore_eos
    assert resolve_max_tokens(None, False, 10, 100) == 90
    assert resolve_max_tokens(16, False, 95, 100) == 5
    with pytest.raises(APIError) as e:
        resolve_max_tokens(16, True, 95, 100)
    assert e.value.status == 400 and e.value.param == "max_tokens"
    with pytest.raises(APIError) as e:
        resolve_max_tokens(None, False, 100, 100)
    assert e.value.param == "prompt"
    both = CompletionRequest(prompt="x", guided_regex="a", response_format={"type": "json_object"})
    with pytest.raises(APIError, match="at most one"):
        structured_from_request(both)
    so = structured_from_request(CompletionRequest(prompt="x", structured_outputs={"choice": ["a", "b"]}))
    assert so.regex == "(a|b)"


def test_error_body_shape():
    from tpuserve.server.api_errors import error_body, param_of

    assert error_body(404, "nope", "model") == {
        "error": {"message": "nope", "type": "NotFoundError", "param": "model", "code": 404}
    }
    assert error_body(418, "tea")["error"]["type"] == "ImATeapotError"
    assert param_of("top_p must be in (0, 1], got 2") == "top_p"
    assert param_of("prompt: too long") == "prompt"


# ---- async engine (with a fake engine: no model needed) ----


class _FakeEngine:
    """Just enough of LLMEngine: each request emits one token per step until max_tokens."""

    def __init__(self, max_running: int = 1):
        from types import SimpleNamespace

        self.tokenizer = None
        self.max_model_len = 64
        self.arch = SimpleNamespace(vocab_size=100)
        self.requests: dict[str, list] = {}
        self.order: list[str] = []
        self.max_running = max_running
        self.pool = SimpleNamespace(num_free=10, num_usable=10, usage=lambda: 0.0)
        from tpuserve.server.engine import EngineStats

        self.stats = EngineStats()
        self.scheduler = SimpleNamespace(waiting=[])

    @property
    def num_running(self):
        return min(len(self.order), self.max_running)

    @property
    def num_waiting(self):
        return max(0, len(self.order) - self.max_running)

    def _sync_waiting(self):
        from types import SimpleNamespace

        self.scheduler.waiting = [SimpleNamespace(request_id=r) for r in self.order[self.max_running :]]

    def add_request(self, rid, prompt, params, prompt_token_ids=None, **extra):
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        self.requests[rid] = [params.max_tokens, []]
        self.order.append(rid)
        self._sync_waiting()

    def abort_request(self, rid):
        if rid not in self.requests:
            return None
        self.requests.pop(rid)
        self.order.remove(rid)
        self._sync_waiting()
        return self._out(rid, [], "abort")

    def has_unfinished_requests(self):
        return bool(self.requests)

    def _out(self, rid, toks, reason):
        from tpuserve.server.outputs import CompletionOutput, RequestOutput

        return RequestOutput(
            rid,
            None,
            [1],
            [CompletionOutput(0, "x" * len(toks), list(toks), finish_reason=reason)],
            finished=reason is not None,
        )

    def step(self):
        import time as _t

        _t.sleep(0.002)
        outs = []
        for rid in list(self.order[: self.max_running]):
            limit, toks = self.requests[rid]
            toks.append(len(toks))
            reason = "length" if len(toks) >= limit else None
            outs.append(self._out(rid, toks, reason))
            if reason:
                self.requests.pop(rid)
                self.order.remove(rid)
        self._sync_waiting()
        return outs


def test_async_engine_streams_bounds_queue_and_aborts():
    from tpuserve.server.async_engine import AsyncEngine, QueueFullError
    from tpuserve.server.sampling_params import SamplingParams

    async def main():
        ae = AsyncEngine(_FakeEngine(max_running=1), max_waiting_requests=2)
        ae.start()
        try:
            outs = [o async for o in ae.generate("a", [1, 2], SamplingParams(max_tokens=5))]
            assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5]
            assert outs[-1].finished and ae.num_active == 0
            with pytest.raises(ValueError, match="prompt"):
                await ae.add_request("bad", None, SamplingParams(), [])
            # One running + two waiting; the fourth is refused.
            streams = [
                await ae.add_request(f"q{i}", None, SamplingParams(max_tokens=200), [1]) for i in range(3)
            ]
            with pytest.raises(QueueFullError):
                await ae.add_request("q3", None, SamplingParams(max_tokens=200), [1])
            # Leaving a stream early aborts its request.
            async for _ in streams[0]:
                break
            for s in streams[1:]:
                s.abort()
            deadline = time.monotonic() + 30  # the engine thread ends them; a loaded machine is slow
            while (ae.engine.requests or ae.num_active) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert not ae.engine.requests
        finally:
            await ae.shutdown()
        assert not ae.is_healthy

    asyncio.run(main())


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_deeply_nested_schemas_are_refused_before_compiling(tokenizer, monkeypatch):
    """900 nested arrays took xgrammar ~35 s of two busy cores; the depth limit refuses them before
    any compiler is built or called (checked by making both fail, not by a wall clock: CI's busy
    cores made a 2 s bound flaky)."""
    import xgrammar as xgr

    from tpuserve.server import structured_output
    from tpuserve.server.sampling_params import StructuredOutputParams
    from tpuserve.server.structured_output import (
        MAX_SCHEMA_DEPTH,
        compile_structured_output,
        tool_call_grammar,
    )

    def must_not_compile(*args, **kwargs):
        raise AssertionError("a too-deep schema reached the grammar compiler")

    with monkeypatch.context() as m:
        m.setattr(structured_output, "_compiler", must_not_compile)
        m.setattr(xgr.Grammar, "from_json_schema", must_not_compile)
        for schema in (_nested_arrays(900), json.dumps(_nested_arrays(900))):
            with pytest.raises(ValueError, match=f"nested 901 levels deep.*limit of {MAX_SCHEMA_DEPTH}"):
                compile_structured_output(StructuredOutputParams(json=schema), tokenizer, len(tokenizer))
        with pytest.raises(ValueError, match="tools: .*nested"):
            tool_call_grammar([{"name": "f", "parameters": _nested_arrays(900)}])
    # At the limit it compiles.
    compile_structured_output(
        StructuredOutputParams(json=_nested_arrays(MAX_SCHEMA_DEPTH - 1)), tokenizer, len(tokenizer)
    )


class _BlockedCompiles:
    """Stands in for compile_structured_output: each call blocks until ``release`` is set, so a
    request answered while they block was answered by the deadline, however slow the machine."""

    def __init__(self):
        self.calls = 0
        self.release = threading.Event()

    def __call__(self, so, tokenizer, vocab_size):
        self.calls += 1
        assert self.release.wait(60), "never released"


def _context(timeout_s: float):
    from types import SimpleNamespace

    from tpuserve.server.serving_common import ServingContext

    engine = SimpleNamespace(tokenizer=None, vocab_size=100, max_model_len=64)
    return ServingContext(engine=engine, model_name="m", model_root="m", grammar_timeout_s=timeout_s)


def test_grammar_compile_deadline_answers_400_and_a_full_lane_503(monkeypatch):
    """The deadline mechanism (the real compile is too fast to time out on purpose): a compile past
    the deadline is a 400 naming the flag; requests that could not start because every grammar
    worker was busy get a 503; tokenization runs on its own lane meanwhile."""
    import tpuserve.server.serving_common as sc
    from tpuserve.server.api_errors import APIError
    from tpuserve.server.sampling_params import StructuredOutputParams

    compiles = _BlockedCompiles()
    monkeypatch.setattr(sc, "compile_structured_output", compiles)
    ctx = _context(0.3)
    so = StructuredOutputParams(regex="a+")

    async def one():
        try:
            await ctx.compile_grammar(so)
        except APIError as e:
            return e.status, str(e)
        return 200, ""

    async def scenario():
        # Bounded well below the compiles' 60 s: answered at the deadline, not when they end.
        results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(sc.GRAMMAR_WORKERS + 2))), 30)
        # The tokenizer lane is free while both grammar workers are busy (still blocked).
        assert await asyncio.wait_for(ctx.blocking(lambda: 7), 30) == 7
        return results

    try:
        results = asyncio.run(scenario())
    finally:
        compiles.release.set()
        ctx.grammar_executor.shutdown(wait=True)  # whatever was still queued would run now
        ctx.shutdown()
    statuses = sorted(s for s, _ in results)
    assert statuses == [400] * sc.GRAMMAR_WORKERS + [503] * 2, results
    assert all("--grammar-compile-timeout" in m for s, m in results if s == 400)
    assert all("busy" in m for s, m in results if s == 503)
    assert compiles.calls == sc.GRAMMAR_WORKERS  # the queued ones were cancelled, not compiled


def test_grammar_compile_within_the_deadline_passes_and_bad_grammars_stay_400(monkeypatch, tokenizer):
    from types import SimpleNamespace

    from tpuserve.server.api_errors import APIError
    from tpuserve.server.sampling_params import StructuredOutputParams
    from tpuserve.server.serving_common import ServingContext

    engine = SimpleNamespace(tokenizer=tokenizer, vocab_size=len(tokenizer), max_model_len=64)
    ctx = ServingContext(engine=engine, model_name="m", model_root="m", grammar_timeout_s=60)
    try:
        asyncio.run(ctx.compile_grammar(StructuredOutputParams(regex="(yes|no)")))
        with pytest.raises(APIError) as e:
            asyncio.run(ctx.compile_grammar(StructuredOutputParams(json=_nested_arrays(500))))
        assert e.value.status == 400 and "nested" in str(e.value)
    finally:
        ctx.shutdown()

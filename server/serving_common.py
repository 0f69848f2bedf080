"""Pieces shared by the completions and chat handlers: request -> SamplingParams, prompt checks,
submitting to the engine, merging several request streams, SSE framing, logprob formatting."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel

from tpuserve.server.api_errors import APIError, bad_request, error_body, param_of
from tpuserve.server.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError, RequestStream
from tpuserve.server.outputs import Logprob, RequestOutput
from tpuserve.server.protocol import MAX_STOP, SamplingFields
from tpuserve.server.sampling_params import SamplingParams, StructuredOutputParams
from tpuserve.server.structured_output import choice_regex, compile_structured_output

MAX_PROMPTS = 256  # prompts in one /v1/completions request


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_name: str
    model_root: str
    extra_model_names: tuple[str, ...] = ()
    chat_template: str | None = None
    # One worker: tokenization and grammar compilation stay off the event loop, and the tokenizer
    # is never used by two server threads at once.
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tpuserve-tok"))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is None or model == self.model_name or model in self.extra_model_names:
            return
        raise APIError(404, f"The model `{model}` does not exist.", "model")

    async def blocking(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.blocking(_encode, self.tokenizer, text, add_special_tokens)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        v = self.engine.vocab_size
        for t in ids:
            if not 0 <= t < v:
                raise bad_request(f"{param}: token id {t} is outside the vocabulary [0, {v})", param)

    async def compile_grammar(self, so: StructuredOutputParams | None) -> None:
        """Compile the request's grammar now (off the engine thread; errors answer 400)."""
        if so is None:
            return
        try:
            await self.blocking(compile_structured_output, so, self.tokenizer, self.engine.vocab_size)
        except ValueError as e:
            raise bad_request(str(e), "response_format")

    async def submit(self, items: list[tuple[str, str | None, list[int], SamplingParams]]
                     ) -> list[RequestStream]:
        """Add each (request_id, prompt text, prompt ids, params) as an engine request; all or none."""
        streams: list[RequestStream] = []
        try:
            for rid, text, ids, params in items:
                streams.append(await self.engine.add_request(rid, text, params, ids))
        except BaseException as e:
            for s in streams:
                self.engine.abort(s.request_id)
            if isinstance(e, ValueError):
                raise bad_request(str(e), param_of(str(e))) from e
            if isinstance(e, (QueueFullError, EngineUnavailableError)):
                raise APIError(503, str(e)) from e
            raise
        return streams


@dataclass
class StreamingResult:
    """A streaming answer: SSE text events, plus the engine requests behind them so that the
    response can abort them even if it never started iterating the events."""

    events: AsyncIterator[str]
    streams: list[RequestStream]

    def close(self) -> None:
        for s in self.streams:
            s.abort()


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def structured_from_request(req: SamplingFields) -> StructuredOutputParams | None:
    """response_format / structured_outputs / guided_* -> one StructuredOutputParams (or None)."""
    found: list[tuple[str, StructuredOutputParams]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", StructuredOutputParams(json_object=True)))
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format.json_schema.schema: required when type is "
                                  "'json_schema'", "response_format")
            found.append(("response_format", StructuredOutputParams(json=rf.json_schema.schema_)))
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("grammar", so.grammar),
                                   ("choice", so.choice)) if v is not None}
        if so.json_object:
            given["json_object"] = True
        if len(given) != 1:
            raise bad_request("structured_outputs: give exactly one of json, json_object, regex, "
                              "grammar, choice", "structured_outputs")
        found.append(("structured_outputs", _structured(given)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_grammar", "grammar"), ("guided_choice", "choice")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _structured({key: value})))
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]}: give at most one output constraint",
                          found[1][0])
    return found[0][1] if found else None


def _structured(given: dict) -> StructuredOutputParams:
    key, value = next(iter(given.items()))
    if key == "choice":
        try:
            return StructuredOutputParams(regex=choice_regex(value))
        except ValueError as e:
            raise bad_request(str(e), "structured_outputs") from e
    if key == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"json schema: not valid JSON ({e})", "structured_outputs") from e
    return StructuredOutputParams(**{key: value})


def resolve_max_tokens(requested: int | None, explicit: bool, prompt_len: int,
                       max_model_len: int) -> int:
    """The number of tokens a request may generate; 400 when it cannot fit the context."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, and the "
                          f"prompt has {prompt_len} tokens; shorten the prompt.", "prompt")
    if requested is None:
        return room
    if explicit and requested > room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, "
                          f"you requested {prompt_len + requested} tokens ({prompt_len} in the "
                          f"prompt, {requested} for the completion). Lower max_tokens.", "max_tokens")
    return min(requested, room)


def make_sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         structured: StructuredOutputParams | None = None) -> SamplingParams:
    if req.logit_bias:
        raise bad_request("logit_bias: not supported by this server", "logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise bad_request(f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", "stop")
    try:
        params = SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured_outputs=structured)
    except ValueError as e:
        raise bad_request(str(e), param_of(str(e))) from e
    return params


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output). Closing the merged iterator
    (client gone) cancels the readers, which aborts every unfinished request."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as e:  # reported to the consumer; cancellation passes through
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def outputs_or_error(merged: AsyncIterator[tuple[int, RequestOutput]]
                            ) -> AsyncIterator[tuple[int, RequestOutput | str]]:
    """Pass outputs through; if a request fails or the engine becomes unavailable mid-stream, end
    with one SSE error event (an HTTP status can no longer be sent once streaming began)."""
    try:
        async for i, out in merged:
            if out.error:
                yield i, sse({"error": error_body(500, f"request failed: {out.error}")["error"]})
                return
            yield i, out
    except (EngineUnavailableError, QueueFullError) as e:
        yield -1, sse({"error": error_body(503, str(e))["error"]})


async def collect_final(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        finals[i] = out
    return [f for f in finals if f is not None]


def sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_unset=False)
    elif isinstance(payload, dict):
        payload = json.dumps(payload, ensure_ascii=False)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def ranked_top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k (rank 1..k) entries of one position's logprobs, best first."""
    tops = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    tops.sort(key=lambda x: x[1].rank)
    return tops[:k]


def token_text(lp: Logprob | None, tokenizer, token_id: int) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    from tpuserve.server.detokenizer import decode_token
    return decode_token(tokenizer, token_id)


def finite(x: float) -> float:
    """JSON has no -inf: clamp impossible tokens' logprobs the way vLLM does."""
    return max(x, -9999.0)

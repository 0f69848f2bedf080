"""Pieces shared by the completions and chat handlers: request -> SamplingParams, prompt checks,
submitting to the engine, merging several request streams, SSE framing, logprob formatting."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tpuserve.kv_cache.transfer.errors import KVTransferError
from tpuserve.kv_cache.transfer.transport import check_kv_transfer_params
from tpuserve.server.api_errors import APIError, bad_request, error_body, param_of
from tpuserve.server.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError, RequestStream
from tpuserve.server.data_parallel import DataParallelEngine
from tpuserve.server.detokenizer import decode_token
from tpuserve.server.outputs import Logprob, RequestOutput
from tpuserve.server.protocol import MAX_STOP, SamplingFields
from tpuserve.server.sampling_params import SamplingParams, StructuredOutputParams
from tpuserve.server.structured_output import choice_regex, compile_structured_output
from tpuserve.tpu_platform.config import KVLoadFailurePolicy

MAX_PROMPTS = 256  # prompts in one /v1/completions request
# Prompt characters allowed per token of max_model_len (``--max-prompt-chars-per-token``): text this
# long cannot fit the context whatever the tokenizer does (~4 characters per token in English, a few
# dozen at most for runs of spaces or symbols), so it is refused before any time is spent on it.
DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN = 32.0
# Texts longer than this are tokenized on their own worker ("bulk" lane): a long tokenization must
# not hold up the short ones queued behind it.
BULK_CHARS = 32 * 1024
# Grammar compilation: its own lane of this many threads, and a deadline per request.
GRAMMAR_WORKERS = 2
DEFAULT_GRAMMAR_TIMEOUT_S = 10.0

log = logging.getLogger(__name__)


def _drop_result(job: asyncio.Future) -> None:
    """Collect a timed-out compile's outcome, so its error (if any) is not logged as unretrieved."""
    if not job.cancelled():
        job.exception()


@dataclass
class ServingContext:
    engine: AsyncEngine | DataParallelEngine
    model_name: str
    model_root: str
    extra_model_names: tuple[str, ...] = ()
    chat_template: str | None = None
    max_prompt_chars_per_token: float = DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN
    # Seconds a request's grammar may take to compile (--grammar-compile-timeout).
    grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S
    # One worker: short tokenizations stay off the event loop (and off the engine thread), and this
    # lane never uses the tokenizer from two threads at once.
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tpuserve-tok")
    )
    # The grammar lane: compiles take from milliseconds to minutes, so they never share a lane with
    # tokenization (one slow schema held every request's tokenization behind it).
    grammar_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="tpuserve-grammar")
    )
    # The bulk lane: long texts, one at a time, with a tokenizer copy of its own (a Rust tokenizer
    # object must not be borrowed by two threads while one of them may reconfigure it).
    bulk_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tpuserve-tok-bulk")
    )
    _bulk_tokenizer: Any = field(default=None, init=False, repr=False)

    def start(self) -> None:
        """Make the bulk lane's tokenizer copy now, on that lane (it takes seconds), so that the
        first long prompt does not wait for it."""
        self.bulk_executor.submit(self._bulk_tok)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.grammar_executor.shutdown(wait=False, cancel_futures=True)
        self.bulk_executor.shutdown(wait=False, cancel_futures=True)

    def _bulk_tok(self):
        # Only ever called on the bulk lane's single thread: no lock needed.
        if self._bulk_tokenizer is None:
            try:
                self._bulk_tokenizer = copy.deepcopy(self.tokenizer)
            except Exception as e:  # an uncopyable tokenizer: share it rather than fail
                log.warning("could not copy the tokenizer for the bulk lane (%s); sharing it", e)
                self._bulk_tokenizer = self.tokenizer
        return self._bulk_tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.engine.engine, "eos_token_ids", ()) or ())

    def visible_token_count(self, c, ignore_eos: bool) -> int:
        """How many of ``c.token_ids`` make up ``c.text``: all but a final end token (EOS, or a
        ``stop_token_ids`` hit) that finished the sequence, which the engine keeps out of the text."""
        n = len(c.token_ids)
        if c.finish_reason != "stop" or not n:
            return n
        last = c.token_ids[-1]
        stop_token = type(c.stop_reason) is int and c.stop_reason == last
        eos = c.stop_reason is None and not ignore_eos and last in self.eos_token_ids
        return n - 1 if stop_token or eos else n

    @property
    def max_prompt_chars(self) -> int:
        return int(self.max_model_len * self.max_prompt_chars_per_token)

    def check_prompt_chars(self, n_chars: int, param: str, what: str = "prompt") -> None:
        """400 for text too long to fit the context, before it is tokenized."""
        limit = self.max_prompt_chars
        if n_chars > limit:
            raise bad_request(
                f"{param}: the {what} is {n_chars} characters long, over this server's limit of "
                f"{limit} characters (max_model_len={self.max_model_len} tokens x "
                f"{self.max_prompt_chars_per_token:g} characters per token, "
                f"--max-prompt-chars-per-token); shorten it",
                param,
            )

    async def with_tokenizer(self, n_chars: int, fn: Callable, *args) -> Any:
        """Run ``fn(tokenizer, *args)`` on the tokenizer lane that fits an input of ``n_chars``."""
        if n_chars > BULK_CHARS:
            return await asyncio.get_running_loop().run_in_executor(
                self.bulk_executor, lambda: fn(self._bulk_tok(), *args)
            )
        return await self.blocking(fn, self.tokenizer, *args)

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

    async def tokenize(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_prompt_chars(len(text), param)
        return await self.with_tokenizer(len(text), _encode, text, add_special_tokens)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        v = self.engine.vocab_size
        if ids and 0 <= min(ids) and max(ids) < v:  # the common case, without a Python loop
            return
        for t in ids:
            if not 0 <= t < v:
                raise bad_request(f"{param}: token id {t} is outside the vocabulary [0, {v})", param)

    async def compile_grammar(self, so: StructuredOutputParams | None) -> None:
        """Compile the request's grammar now, on the grammar lane (off the event loop and the engine
        thread). A bad grammar answers 400; one that does not compile within the deadline answers
        400 too, and one that could not even start (every grammar worker busy with others) 503.
        A compile past its deadline runs on (a compile cannot be interrupted) and lands in the
        cache, so the same grammar asked again is quick."""
        if so is None:
            return
        started = threading.Event()

        def compile_now():
            started.set()
            return compile_structured_output(so, self.tokenizer, self.engine.vocab_size)

        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self.grammar_executor, compile_now)
        try:
            await asyncio.wait_for(asyncio.shield(job), self.grammar_timeout_s)
        except ValueError as e:
            raise bad_request(str(e), "response_format") from None
        except TimeoutError:
            job.add_done_callback(_drop_result)
            t = f"{self.grammar_timeout_s:g} s"
            if not started.is_set():
                job.cancel()  # still queued: nobody is waiting for it any more
                raise APIError(
                    503,
                    f"structured output: the grammar compiler is busy with other "
                    f"requests and did not reach this one within {t}; retry",
                ) from None
            raise bad_request(
                f"response_format: the grammar did not compile within {t} "
                f"(--grammar-compile-timeout); simplify the schema, regex or grammar",
                "response_format",
            ) from None

    async def pull_remote_kv(self, kv_transfer_params: dict | None):
        """A decode request's prefill pages, pulled off the engine thread (None when the request
        carries none). A failed pull answers 502, or returns None to recompute the prompt, as the
        server's kv_load_failure_policy says."""
        if not kv_transfer_params or not kv_transfer_params.get("do_remote_prefill"):
            return None
        role = self.engine.engine.kv_role
        if role is None or not role.consumes:
            raise bad_request(
                "kv_transfer_params: this server is not a KV consumer (start it with "
                '--kv-transfer-config \'{"kv_role": "kv_consumer"}\')',
                "kv_transfer_params",
            )
        try:
            return await self.blocking(role.pull, kv_transfer_params)
        except ValueError as e:
            raise bad_request(str(e), "kv_transfer_params") from e
        except KVTransferError as e:
            if role.cfg.kv_load_failure_policy == KVLoadFailurePolicy.RECOMPUTE:
                log.warning("pulling remote KV failed (%s); recomputing the prompt", e)
                return None
            raise APIError(502, f"could not load the prefill's KV cache: {e}") from e

    async def submit(
        self,
        items: list[tuple[str, str | None, list[int], SamplingParams]],
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> list[RequestStream]:
        """Add each (request_id, prompt text, prompt ids, params) as an engine request; all or none."""
        streams: list[RequestStream] = []
        if kv_transfer_params:
            try:
                check_kv_transfer_params(kv_transfer_params)
            except ValueError as e:
                raise bad_request(str(e), "kv_transfer_params") from e
        remote_kv = await self.pull_remote_kv(kv_transfer_params)
        if remote_kv is not None and len(items) != 1:
            raise bad_request("kv_transfer_params: a decode request carries one prompt", "kv_transfer_params")
        try:
            for rid, text, ids, params in items:
                streams.append(
                    await self.engine.add_request(
                        rid,
                        text,
                        params,
                        ids,
                        cache_salt=cache_salt,
                        kv_transfer_params=kv_transfer_params,
                        remote_kv=remote_kv,
                    )
                )
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
                raise bad_request(
                    "response_format.json_schema.schema: required when type is 'json_schema'",
                    "response_format",
                )
            found.append(("response_format", StructuredOutputParams(json=rf.json_schema.schema_)))
    so = req.structured_outputs
    if so is not None:
        given: dict[str, object] = {
            k: v
            for k, v in (
                ("json", so.json_),
                ("regex", so.regex),
                ("grammar", so.grammar),
                ("choice", so.choice),
            )
            if v is not None
        }
        if so.json_object:
            given["json_object"] = True
        if len(given) != 1:
            raise bad_request(
                "structured_outputs: give exactly one of json, json_object, regex, grammar, choice",
                "structured_outputs",
            )
        found.append(("structured_outputs", _structured(given)))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_grammar", "grammar"),
        ("guided_choice", "choice"),
    ):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _structured({key: value})))
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]}: give at most one output constraint", found[1][0])
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


def resolve_max_tokens(requested: int | None, explicit: bool, prompt_len: int, max_model_len: int) -> int:
    """The number of tokens a request may generate; 400 when it cannot fit the context."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, and the "
            f"prompt has {prompt_len} tokens; shorten the prompt.",
            "prompt",
        )
    if requested is None:
        return room
    if explicit and requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {prompt_len + requested} tokens ({prompt_len} in the "
            f"prompt, {requested} for the completion). Lower max_tokens.",
            "max_tokens",
        )
    return min(requested, room)


def make_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: StructuredOutputParams | None = None,
) -> SamplingParams:
    if req.logit_bias:
        raise bad_request("logit_bias: not supported by this server", "logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise bad_request(f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", "stop")
    try:
        params = SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured_outputs=structured,
        )
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


async def outputs_or_error(
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput | str]]:
    """Pass outputs through; if a request fails or the engine becomes unavailable mid-stream, end
    with one SSE error event (an HTTP status can no longer be sent once streaming began)."""
    try:
        async for i, out in merged:
            if out.error:
                yield i, sse({"error": error_body(out.error_status, f"request failed: {out.error}")["error"]})
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
    tops.sort(key=lambda x: x[1].rank or 0)  # (every rank is set: filtered above)
    return tops[:k]


def token_text(lp: Logprob | None, tokenizer, token_id: int) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode_token(tokenizer, token_id)


def finite(x: float) -> float:
    """JSON has no -inf: clamp impossible tokens' logprobs the way vLLM does."""
    return max(x, -9999.0)

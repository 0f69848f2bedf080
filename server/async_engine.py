"""Asynchronous front of the engine: the engine loop runs in its own thread, requests stream back
through per-request asyncio queues.

Threads: ``LLMEngine`` is not thread-safe, so every engine call (add, abort, step) happens on the
engine thread. The event loop hands work over through a thread-safe command queue; the engine thread
hands results back with ``loop.call_soon_threadsafe`` (one callback per step for all requests). After
every step the engine thread also publishes an :class:`EngineSnapshot` (counts, KV usage, token
counters) that the event loop reads for admission control, ``/metrics`` and ``/health``.

Admission: at most ``max_waiting_requests`` requests may wait for a slot (requests submitted but not
yet added, plus requests the scheduler has not admitted); past that ``add_request`` raises
:class:`QueueFullError` (the server answers 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tpuserve.server.outputs import RequestOutput
from tpuserve.server.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; try again later (HTTP 503)."""


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down or its loop died (HTTP 503)."""


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int = 0
    num_waiting: int = 0  # sequences the scheduler has not admitted yet
    num_waiting_requests: int = 0
    num_unfinished_requests: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    host_cache_queries: int = 0
    host_cache_hits: int = 0
    host_bytes_loaded: int = 0
    host_bytes_saved: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    steps: int = 0
    compiled_programs: int = 0
    warmup_remaining: int = 0  # compile tasks of the background warm-up still to finish
    routed_per_replica: tuple[int, ...] = ()  # data parallel: requests sent to each replica


@dataclass
class _Timing:
    arrival: float
    tokens: int = 0
    last: float | None = None


class RequestStream:
    """The outputs of one request, as the engine produces them (cumulative ``RequestOutput``s; the
    last one has ``finished`` set). Iterate it once. Leaving the iteration early (a client that
    disconnects, a cancelled task) aborts the request in the engine, which frees its KV pages."""

    def __init__(self, request_id: str, owner: AsyncEngine):
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def abort(self) -> None:
        """Abort the request unless its final output was already read."""
        if not self.finished:
            self._owner.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                if item.finished:
                    self.finished = True
                yield item
                if self.finished:
                    return
        finally:
            if not self.finished:
                self._owner.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine, max_waiting_requests: int = 1024, metrics: Any = None):
        """``engine``: an ``LLMEngine``. ``metrics``: optional observer with ``observe_first_token``,
        ``observe_inter_token`` and ``observe_finished`` (called from the engine thread)."""
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests: must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.arch.vocab_size
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side: accepted, not finished
        self._engine_streams: dict[str, RequestStream] = {}  # engine-thread side
        self._timing: dict[str, _Timing] = {}  # engine-thread side
        self._pending_adds = 0  # event-loop side: submitted, not yet answered by the engine thread
        self._accepting = False
        self._error: BaseException | None = None
        self.snapshot = self._take_snapshot()

    # ---- lifecycle ----

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="tpuserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop accepting; give in-flight requests up to ``grace_s`` seconds to finish, abort the
        rest, then stop the engine thread."""
        self._accepting = False
        stop_warmup = getattr(self.engine, "stop_warmup", None)
        if stop_warmup is not None:
            stop_warmup()  # compiles not started yet would hold the process after the server stops
        deadline = time.monotonic() + max(0.0, grace_s)
        while self._streams and time.monotonic() < deadline and self.is_healthy:
            await asyncio.sleep(0.02)
        for rid in list(self._streams):
            self.abort(rid)
        if self._thread is not None:
            self._commands.put(("stop",))
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)
            self._thread = None
        release = getattr(self.engine, "shutdown", None)
        if release is not None:
            release()  # a multi-host engine's other hosts return from their follower loops

    # ---- requests (event loop side) ----

    async def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
        remote_kv: Any = None,
    ) -> RequestStream:
        """Hand a request to the engine. Returns its stream once the engine accepted it; raises
        ValueError (bad input), QueueFullError or EngineUnavailableError."""
        if not self._accepting or not self.is_healthy:
            raise EngineUnavailableError("the engine is not accepting requests (shutting down or failed)")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self._pending_adds + self.snapshot.num_waiting_requests >= self.max_waiting_requests:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_waiting_requests} requests waiting); retry later"
            )
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        accepted.add_done_callback(_consume_exception)
        stream = RequestStream(request_id, self)
        self._pending_adds += 1
        extra = dict(cache_salt=cache_salt, kv_transfer_params=kv_transfer_params, remote_kv=remote_kv)
        self._commands.put(
            ("add", request_id, prompt, params, prompt_token_ids, extra, stream, accepted, time.monotonic())
        )
        try:
            await asyncio.shield(accepted)
        except asyncio.CancelledError:
            # The caller went away while the engine was adding: make sure nothing is left running.
            self.abort(request_id)
            raise
        finally:
            self._pending_adds -= 1
        self._streams[request_id] = stream
        return stream

    def generate(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        return generate_through(self, request_id, prompt, params, prompt_token_ids)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; a no-op for unknown or finished requests)."""
        self._commands.put(("abort", request_id))

    # ---- engine thread ----

    def _call(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call
                pass

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._handle_commands(block=not busy):
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._publish(outputs)
                self.snapshot = self._take_snapshot()
        except BaseException as e:  # the loop must never die silently
            log.exception("engine loop failed")
            self._error = e
            self._fail_all(EngineUnavailableError(f"the engine loop failed: {type(e).__name__}: {e}"))
        finally:
            self.snapshot = self._take_snapshot()

    def _handle_commands(self, block: bool) -> bool:
        """Run queued commands; when ``block``, wait for the first one. False on 'stop'."""
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                if block:
                    # Idle: the counts a background warm-up moves still reach /metrics and /health.
                    self.snapshot = self._take_snapshot()
                    continue
                return True
            block = False
            kind = cmd[0]
            if kind == "stop":
                for rid in list(self._engine_streams):
                    self._abort_in_engine(rid)
                return False
            if kind == "add":
                self._add(*cmd[1:])
            elif kind == "abort":
                self._abort_in_engine(cmd[1])

    def _add(self, request_id, prompt, params, prompt_token_ids, extra, stream, accepted, arrival) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids, **extra)
        except Exception as e:  # ValueError: bad input; anything else: reported to that request only
            if not isinstance(e, ValueError):
                log.exception("add_request %s failed", request_id)
            self._call(_settle, accepted, e)
            return
        self._engine_streams[request_id] = stream
        self._timing[request_id] = _Timing(arrival)
        self.snapshot = self._take_snapshot()
        self._call(_settle, accepted, None)

    def _abort_in_engine(self, request_id: str) -> None:
        stream = self._engine_streams.pop(request_id, None)
        self._timing.pop(request_id, None)
        out = self.engine.abort_request(request_id)
        if stream is not None and out is not None:
            self._call(self._deliver, [(stream, out)])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batch = []
        for out in outputs:
            stream = self._engine_streams.get(out.request_id)
            if stream is None:
                continue
            self._observe(out, now)
            if out.finished:
                del self._engine_streams[out.request_id]
            batch.append((stream, out))
        if batch:
            self._call(self._deliver, batch)

    def _observe(self, out: RequestOutput, now: float) -> None:
        timing = self._timing.get(out.request_id)
        if timing is None:
            return
        tokens = sum(len(c.token_ids) for c in out.outputs)
        m = self.metrics
        if tokens > timing.tokens and m is not None:
            if timing.last is None:
                m.observe_first_token(now - timing.arrival)
            else:
                m.observe_inter_token(now - timing.last)
        if tokens > timing.tokens:
            timing.tokens, timing.last = tokens, now
        if out.finished:
            del self._timing[out.request_id]
            if m is not None:
                reason = out.outputs[0].finish_reason if out.outputs else None
                m.observe_finished(now - timing.arrival, reason)

    def _fail_all(self, error: BaseException) -> None:
        streams = list(self._engine_streams.values())
        self._engine_streams.clear()
        self._accepting = False
        if streams:
            self._call(self._deliver_error, streams, error)
        # Requests submitted but never added: answer them too.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._call(_settle, cmd[7], error)

    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        pool = e.pool
        stats = e.stats
        waiting_reqs = len({s.request_id for s in e.scheduler.waiting})
        return EngineSnapshot(
            num_running=e.num_running,
            num_waiting=e.num_waiting,
            num_waiting_requests=waiting_reqs,
            num_unfinished_requests=len(e.requests),
            free_blocks=pool.num_free,
            total_blocks=pool.num_usable,
            kv_cache_usage=pool.usage(),
            prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            host_cache_queries=stats.host_cache_queries,
            host_cache_hits=stats.host_cache_hits,
            host_bytes_loaded=stats.host_bytes_loaded,
            host_bytes_saved=stats.host_bytes_saved,
            spec_num_drafts=stats.spec_num_drafts,
            spec_num_draft_tokens=stats.spec_num_draft_tokens,
            spec_num_accepted_tokens=stats.spec_num_accepted_tokens,
            spec_accepted_per_pos=tuple(stats.spec_accepted_per_pos),
            steps=stats.steps,
            compiled_programs=_compile_count(e),
            warmup_remaining=int(getattr(e, "warmup_remaining", 0)),
        )

    # ---- event loop side ----

    def _deliver_error(self, streams: list[RequestStream], error: BaseException) -> None:
        for stream in streams:
            stream._put(error)
            self._streams.pop(stream.request_id, None)

    def _deliver(self, batch: list[tuple[RequestStream, RequestOutput]]) -> None:
        for stream, out in batch:
            stream._put(out)
            if out.finished:
                self._streams.pop(stream.request_id, None)


async def generate_through(
    engine, request_id: str, prompt: str | list[int] | None, params, prompt_token_ids: list[int] | None = None
) -> AsyncIterator[RequestOutput]:
    """A request's outputs as an async iterator, through ``engine.add_request`` (an AsyncEngine or
    anything with its interface, e.g. data_parallel.DataParallelEngine)."""
    text = prompt if isinstance(prompt, str) else None
    if prompt_token_ids is None and isinstance(prompt, list):
        prompt_token_ids = prompt
    stream = await engine.add_request(request_id, text, params, prompt_token_ids)
    async for out in stream:
        yield out


def _compile_count(engine) -> int:
    runner = getattr(engine, "runner", None)
    return int(getattr(runner, "compile_count", 0) or 0)


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _consume_exception(fut: asyncio.Future) -> None:
    """Mark an add's outcome as seen even when its caller was cancelled before reading it."""
    if not fut.cancelled():
        fut.exception()

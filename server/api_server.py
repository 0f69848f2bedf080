"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

``build_app(async_engine, served_model_name, api_key=None, ...)`` makes the app around an
:class:`~tpuserve.server.async_engine.AsyncEngine`; ``run_server(args)`` builds the engine from CLI flags,
compiles the programs of a first short request, serves while the rest compile in the background
(/health answers 503 "starting" until they are), until SIGTERM / SIGINT (then: stop accepting, let in-flight requests finish
for up to ``--shutdown-timeout`` seconds, abort the rest, exit 0).

Routes: GET /health, /version, /metrics, /v1/models; POST /v1/completions, /v1/chat/completions,
/tokenize, /detokenize; GET / (the built-in page, server/ui/, unless ``--no-ui``). Errors use OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``; every 503 carries ``Retry-After``. With an
API key, every route but /health, /version, the API docs and the page's static files needs it (the
page then asks for the key and sends it with each of its calls).

Slow clients: a request head must arrive within ``--http-header-timeout`` seconds and its body within
``--http-body-timeout`` (408) or the connection is closed (server/http_deadlines.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpuserve import __version__
from tpuserve.server.api_errors import APIError, bad_request, error_body, error_headers, error_response
from tpuserve.server.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError
from tpuserve.server.data_parallel import DataParallelEngine
from tpuserve.server.engine_args import add_engine_args, engine_kwargs
from tpuserve.server.http_deadlines import (
    DEFAULT_BODY_TIMEOUT_S,
    BodyDeadlineMiddleware,
    add_deadline_args,
    deadline_protocol,
)
from tpuserve.server.metrics import CONTENT_TYPE, ServerMetrics
from tpuserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from tpuserve.server.serving_chat import ChatHandler, _message_dict
from tpuserve.server.serving_common import (
    DEFAULT_GRAMMAR_TIMEOUT_S,
    DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN,
    ServingContext,
    StreamingResult,
)
from tpuserve.server.serving_completions import CompletionHandler
from tpuserve.server.structured_output import make_grammar_matcher
from tpuserve.tpu_platform.config import EngineConfig

log = logging.getLogger("tpuserve.api")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


# ---- middleware (pure ASGI, so streaming responses pass through untouched) ----


async def _send_error(send, status: int, message: str, headers: dict | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (error_headers(status, headers) or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


# Routes that answer without the API key: liveness probes and the API description.
OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class APIKeyMiddleware:
    """Every route but ``OPEN_PATHS`` needs ``Authorization: Bearer <key>``: /v1/*, and also
    /tokenize, /detokenize (they run the tokenizer for anyone) and /metrics (it tells traffic)."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                await _send_error(
                    send,
                    401,
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                    {"www-authenticate": "Bearer"},
                )
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answer 413 to request bodies over ``max_bytes`` (by Content-Length, or while reading)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                await _send_error(send, 400, "invalid Content-Length header")
                return
            if too_big:
                await _send_error(
                    send,
                    413,
                    f"request body of {int(length)} bytes is over the limit of {self.max_bytes} bytes",
                )
                return
        received = 0
        limit = self.max_bytes

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI re-raises HTTPExceptions raised while it reads the body.
                    raise StarletteHTTPException(413, f"request body is over the limit of {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that always closes its generator (which aborts the request's
    engine work when the client left early)."""

    def __init__(self, result: StreamingResult):
        super().__init__(result.events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._result = result

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._result.events.aclose()
            finally:
                self._result.close()


async def _until_disconnect(raw: Request, work):
    """Run ``work`` but cancel it when the client disconnects (non-streaming requests: the engine
    request is aborted and its KV pages freed). Returns (result, disconnected)."""
    task = asyncio.ensure_future(work)

    async def watch():
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result(), False
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None, True


# ---- the app ----


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # A lone surrogate inside a union (content: str | parts) also fails the other branches; name
    # the surrogate, the actual problem.
    e = next((x for x in errors if x.get("type") == "lone_surrogate"), errors[0])
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    if e.get("type") == "json_invalid":
        return f"request body is not valid JSON: {e.get('ctx', {}).get('error', msg)}", None
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


def build_app(
    async_engine: AsyncEngine | DataParallelEngine,
    served_model_name: str,
    api_key: str | None = None,
    *,
    model_root: str | None = None,
    extra_model_names: tuple[str, ...] = (),
    chat_template: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    shutdown_grace_s: float = 5.0,
    max_prompt_chars_per_token: float = DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN,
    grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S,
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
    ui: bool = True,
) -> FastAPI:
    metrics = ServerMetrics(served_model_name, lambda: async_engine.snapshot)
    async_engine.metrics = metrics
    ctx = ServingContext(
        engine=async_engine,
        model_name=served_model_name,
        model_root=model_root or served_model_name,
        extra_model_names=tuple(extra_model_names),
        chat_template=chat_template,
        max_prompt_chars_per_token=max_prompt_chars_per_token,
        grammar_timeout_s=grammar_timeout_s,
    )
    completions = CompletionHandler(ctx)
    chat = ChatHandler(ctx)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        ctx.start()
        try:
            yield
        finally:
            await async_engine.shutdown(grace_s=shutdown_grace_s)
            ctx.shutdown()

    app = FastAPI(
        title="tpuserve", version=__version__, lifespan=lifespan, description="OpenAI-compatible LLM server"
    )
    app.state.ctx = ctx
    app.state.metrics = metrics
    app.state.async_engine = async_engine

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(EngineUnavailableError)
    @app.exception_handler(QueueFullError)
    async def _unavailable(request: Request, exc: Exception):
        return error_response(503, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"Not Found: no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> Response:
        # 200 means ready at full speed, as vLLM's and SGLang's /health do (vLLM listens only once
        # compiled; SGLang answers 503 until its warm-up is done): readiness probes and benchmark
        # scripts wait for it, and a load balancer should not send a replica full traffic while its
        # steps still pad to the few compiled buckets. Requests are answered meanwhile.
        if not async_engine.is_healthy:
            return error_response(503, "the engine is not running")
        remaining = async_engine.snapshot.warmup_remaining
        if remaining:
            return error_response(
                503,
                f"starting: warming up ({remaining} compile tasks left); requests are served meanwhile",
            )
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return VersionResponse(version=__version__)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(
            data=[
                ModelCard(id=served_model_name, root=ctx.model_root, max_model_len=async_engine.max_model_len)
            ]
        )

    async def _serve(raw: Request, handler, req):
        result, disconnected = await _until_disconnect(raw, handler.create(req))
        if disconnected:
            return Response(status_code=499)
        if isinstance(result, StreamingResult):
            return SSEResponse(result)
        return JSONResponse(result.model_dump(exclude_none=False))

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request):
        return await _serve(raw, completions, req)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        return await _serve(raw, chat, req)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest):
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            ids = await ctx.tokenize(req.prompt, req.add_special_tokens)
        else:
            assert req.messages is not None  # exactly one of the two, checked above
            conv = [_message_dict(i, m) for i, m in enumerate(req.messages)]
            shim = ChatCompletionRequest.model_construct(
                messages=req.messages, add_generation_prompt=req.add_generation_prompt
            )
            ids = await chat.prompt_ids(conv, None, shim)
        return TokenizeResponse(count=len(ids), max_model_len=async_engine.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest):
        ctx.check_model(req.model)
        ctx.check_token_ids(req.tokens, "tokens")
        # ~4 characters a token: a long id list goes to the bulk lane like a long text.
        text = await ctx.with_tokenizer(4 * len(req.tokens), _decode, req.tokens)
        return DetokenizeResponse(prompt=text)

    open_paths = OPEN_PATHS
    if ui:
        from tpuserve.server.ui import UI_PATHS, add_ui_routes

        add_ui_routes(app)
        # The page's files hold no data and must load without the key so that the page can ask for it.
        open_paths = OPEN_PATHS | UI_PATHS

    # Outermost first on the way in: the API key is checked before the body is read.
    if body_timeout_s is not None:
        app.add_middleware(BodyDeadlineMiddleware, timeout_s=body_timeout_s)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=open_paths)
    return app


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


# ---- CLI (``tpuserve serve``; tpuserve/cli.py calls add_serve_parser) ----


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand: server options plus one flag per EngineConfig field."""
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TPUSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
        "and /metrics (env TPUSERVE_API_KEY)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, replacing the model's",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="waiting requests beyond this are refused with 503 (default 1024)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413 (default 16 MiB)",
    )
    parser.add_argument(
        "--max-prompt-chars-per-token",
        type=_positive_float,
        default=DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN,
        help="a prompt (or rendered chat) longer than max_model_len times this many "
        "characters is refused with 400 before tokenizing (default "
        f"{DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN:g})",
    )
    parser.add_argument(
        "--grammar-compile-timeout",
        type=_positive_float,
        default=DEFAULT_GRAMMAR_TIMEOUT_S,
        help="seconds a request's structured-output grammar may take to compile; "
        "then the request is refused with 400 (default "
        f"{DEFAULT_GRAMMAR_TIMEOUT_S:g})",
    )
    add_deadline_args(parser, _positive_float)
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run on after SIGTERM (default 30)",
    )
    parser.add_argument(
        "--no-ui",
        action="store_true",
        help="do not serve the built-in page (chat playground and live metrics) at /",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="do not compile the shape buckets ahead (by default the server answers once a short "
        "request's are compiled and compiles the rest in the background)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_engine_args(parser)
    parser.set_defaults(func=run_server)
    return parser


def _positive_float(value: str) -> float:
    x = float(value)
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {value}")
    return x


def engine_config_from_args(args: argparse.Namespace):
    return EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def model_names(model: str | None, served: str | None) -> tuple[str, tuple[str, ...]]:
    """(the name /v1/models reports, other names requests may use)."""
    if model is None:
        main = served or DEFAULT_MODEL_NAME
        return main, tuple(n for n in (DEFAULT_MODEL_NAME,) if n != main)
    main = served or model
    others = {model, os.path.basename(os.path.normpath(model))} - {main}
    return main, tuple(sorted(others))


def run_server(args: argparse.Namespace) -> int:
    # Here, not at the top: the engine (and jax) loads to serve, not for --help or the router.
    import uvicorn

    from tpuserve.server.engine import LLMEngine
    from tpuserve.tpu_platform import multihost

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = engine_config_from_args(args)
    # Several hosts: only host 0 serves; the others replay its device calls until it stops.
    group = multihost.initialize(config.parallel)
    if group is not None and not group.is_leader:
        log.info("host %d of %d: following host 0", group.rank, group.num_hosts)
        log.info("host %d: done (%s)", group.rank, multihost.run_follower(config))
        return 0
    engines = []
    for replica in range(config.parallel.data_parallel_size):
        engine = LLMEngine(config, grammar_factory=make_grammar_matcher, replica=replica)
        if not args.no_warmup:
            # Serve once a first short request's programs are compiled; the rest compile on a
            # thread pool while the server answers (/health says 503 "starting" until done).
            log.info("warming up replica %d: the first programs, then the rest in the background", replica)
            engine.start_warmup()
        engines.append(engine)
    replicas = [AsyncEngine(e, max_waiting_requests=args.max_waiting_requests) for e in engines]
    async_engine: AsyncEngine | DataParallelEngine
    if len(replicas) == 1:
        async_engine = replicas[0]
    else:
        async_engine = DataParallelEngine(replicas)
    name, others = model_names(args.model, config.model.served_model_name)
    app = build_app(
        async_engine,
        name,
        api_key=args.api_key,
        model_root=engine.model_source,
        extra_model_names=others,
        chat_template=_read_chat_template(args.chat_template),
        max_body_bytes=args.max_body_bytes,
        shutdown_grace_s=min(5.0, args.shutdown_timeout),
        max_prompt_chars_per_token=args.max_prompt_chars_per_token,
        grammar_timeout_s=args.grammar_compile_timeout,
        body_timeout_s=args.http_body_timeout,
        ui=not args.no_ui,
    )
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        http=deadline_protocol(args.http_header_timeout, args.http_body_timeout),
        timeout_graceful_shutdown=int(max(1, args.shutdown_timeout)),
    )
    server = uvicorn.Server(uv_config)
    # uvicorn handles SIGTERM/SIGINT while it runs (graceful shutdown), then restores these handlers
    # and re-raises the signal: with no-op handlers the process then exits 0, as a graceful stop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _note_signal)
    log.info("serving %s on http://%s:%d", name, args.host, args.port)
    server.run()
    return 0


def _note_signal(signum, frame) -> None:
    log.info("received signal %d after shutdown; exiting", signum)

"""``tpuserve router``: an OpenAI-compatible proxy for disaggregated prefill/decode.

For ``/v1/completions`` and ``/v1/chat/completions`` it sends the request to a prefill server with
``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true}`` (vLLM's
field; vLLM's and tpu-inference's toy proxies do the same), then sends the original request to a
decode server with the ``kv_transfer_params`` the prefill answered with, if any (a decode server
without them computes the prompt itself). The decode answer, streamed or not, is passed through.

Without prefill servers the decode servers are whole replicas: the request goes to one, unchanged.
Backends are chosen among the healthy ones of each pool round-robin, or with ``--policy prefix`` by
the longest prompt prefix a bounded index says each was sent, bounded by the requests in flight. A background task polls each
backend's ``/health``; a backend that cannot be reached while serving is marked unhealthy at once
(and the request tries the pool's next healthy one: nothing was sent to it yet). No healthy
backend: 503. Every upstream failure: 502 with an OpenAI-shaped JSON error. All upstream waits
have timeouts, so a hung backend costs at most the timeout, never a hang.
Clients' requests have the server's read deadlines (``--http-header-timeout``,
``--http-body-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpuserve.server.api_errors import error_response
from tpuserve.server.http_deadlines import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    BodyDeadlineMiddleware,
    add_deadline_args,
    check_timeouts,
    deadline_protocol,
)

log = logging.getLogger(__name__)

# Request headers passed to the backends (auth for servers run with --api-key).
_FORWARD_HEADERS = ("authorization",)


@dataclass
class RouterConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 3.0
    prefill_timeout_s: float = 300.0  # the whole prefill answer
    decode_read_timeout_s: float = 600.0  # between two chunks of a decode answer
    http_header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # a client's request head, from connecting
    http_body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a client's request body, after its head
    policy: str = "round-robin"  # or "prefix": longest cached prefix, bounded by load
    prefix_chunk_chars: int = 256  # prompt text per index entry
    prefix_index_size: int = 65536  # entries (chunk hashes) kept, least recently used evicted
    load_threshold: int = 4  # in-flight requests over the least loaded that forfeit prefix affinity

    def validate(self) -> None:
        for name, urls in (("--prefill", self.prefill_urls), ("--decode", self.decode_urls)):
            if not urls and name == "--decode":
                raise ValueError(f"{name}: give at least one server URL")
            for u in urls:
                if not u.startswith(("http://", "https://")):
                    raise ValueError(f"{name}: {u!r} is not an http(s):// URL")
        for name in (
            "health_interval_s",
            "health_timeout_s",
            "connect_timeout_s",
            "prefill_timeout_s",
            "decode_read_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        check_timeouts(self.http_header_timeout_s, self.http_body_timeout_s)
        if self.policy not in POLICIES:
            raise ValueError(f"--policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("prefix_chunk_chars", "prefix_index_size"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.load_threshold < 0:
            raise ValueError(f"load_threshold must be >= 0, got {self.load_threshold}")


POLICIES = ("round-robin", "prefix")


def prefix_key(body: dict) -> str:
    """The text whose prefix a backend's KV cache would share: the prompt, or the chat messages as
    JSON (leading messages in common serialize to a common prefix), after the model name (another
    model caches nothing of use)."""
    prompt = body.get("messages", body.get("prompt", ""))
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=True, default=str)
    return f"{body.get('model', '')}\n{text}"


def chunk_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """One hash per whole chunk, each chained on the one before: hash i names the whole prefix up
    to chunk i, so equal hashes mean equal prefixes (not just equal chunks)."""
    out: list[bytes] = []
    h = b""
    for i in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = hashlib.blake2b(
            h + text[i : i + chunk_chars].encode("utf-8", "surrogatepass"), digest_size=16
        ).digest()
        out.append(h)
    return out


class PrefixIndex:
    """A bounded, approximate map of prefix-chunk hash -> the backends that recently served a
    request with that prefix (so probably still cache it). LRU over hashes: the router cannot see
    the backends' evictions, so old entries age out instead."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._owners: OrderedDict[bytes, dict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def match(self, hashes: Sequence[bytes], urls: Sequence[str]) -> dict[str, int]:
        """For each url, how many leading chunks it is recorded as holding."""
        out = dict.fromkeys(urls, 0)
        live = set(urls)
        for i, h in enumerate(hashes):
            owners = self._owners.get(h)
            live = live & owners.keys() if owners else set()
            if not live:
                break
            self._owners.move_to_end(h)
            for u in live:
                out[u] = i + 1
        return out

    def record(self, hashes: Sequence[bytes], url: str) -> None:
        for h in hashes:
            owners = self._owners.setdefault(h, {})
            owners[url] = None
            self._owners.move_to_end(h)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)


@dataclass
class Backend:
    url: str
    healthy: bool = True  # optimistic until the first check
    last_error: str | None = None
    requests: int = 0
    in_flight: int = 0  # requests sent and not yet answered in full (the router's own count)
    prefix_hits: int = 0  # requests routed here for a prefix the index says it holds


@dataclass
class BackendPool:
    """The backends of one role: round-robin over the healthy ones, or prefix-aware (``prefix``)."""

    role: str
    backends: list[Backend]
    _next: int = field(default=0, repr=False)
    index: PrefixIndex | None = None  # set for the prefix policy
    load_threshold: int = 4

    @classmethod
    def of(cls, role: str, urls: Sequence[str]) -> BackendPool:
        return cls(role, [Backend(u.rstrip("/")) for u in urls])

    def candidates(self, hashes: Sequence[bytes] = ()) -> list[Backend]:
        """Healthy backends in the order to try them: round-robin, the next start each call; with
        an index, the one holding the longest prefix first unless it is loaded more than
        ``load_threshold`` over the least loaded, then the rest by load."""
        n = len(self.backends)
        start, self._next = self._next, (self._next + 1) % n
        order = [self.backends[(start + i) % n] for i in range(n)]
        healthy = [b for b in order if b.healthy]
        if self.index is None or not healthy:
            return healthy
        by_load = sorted(healthy, key=lambda b: b.in_flight)  # stable: round-robin breaks ties
        matched = self.index.match(hashes, [b.url for b in healthy])
        floor = by_load[0].in_flight
        best = max(matched.values())
        if best == 0:
            return by_load
        near = [b for b in by_load if matched[b.url] == best and b.in_flight <= floor + self.load_threshold]
        if not near:
            return by_load
        first = near[0]
        first.prefix_hits += 1
        return [first, *(b for b in by_load if b is not first)]

    def mark(self, b: Backend, error: str | None) -> None:
        if error is None:
            b.healthy, b.last_error = True, None
        else:
            if b.healthy:
                log.warning("%s server %s marked unhealthy: %s", self.role, b.url, error)
            b.healthy, b.last_error = False, error


class UpstreamError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _prefill_body(body: dict, path: str) -> dict:
    """The prefill request: one token, not streamed, asking the prefill server to keep the KV."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if path.endswith("chat/completions") and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def _json_bytes(body: dict) -> bytes:
    """JSON as forwarded: ASCII, so text the client sent as escapes (a lone surrogate, which UTF-8
    cannot encode) reaches the server as the same escapes, for it to judge."""
    try:
        return json.dumps(body, ensure_ascii=True).encode("ascii")
    except RecursionError:
        # Encoding runs a few frames deeper than decoding did: a body nested just under the
        # decoder's limit can fail here. The client's mistake, answered as a bad body (not a 500).
        raise UpstreamError(400, "request body is not valid JSON: nested too deeply") from None


def _decode_body(body: dict, kv_params: dict | None) -> dict:
    out = dict(body)
    out.pop("kv_transfer_params", None)  # never a client's own: only what the prefill handed out
    if kv_params:
        out["kv_transfer_params"] = kv_params
    return out


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}


async def _json_object(request: Request) -> dict | Response:
    """The request's JSON object, or the 400 response (the server's error shape) to answer."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:
        # Bad JSON, bad UTF-8, or an integer over Python's 4,300-digit conversion limit (a plain
        # ValueError, which once escaped as a 500).
        return error_response(400, f"request body is not valid JSON: {e}")
    except RecursionError:
        return error_response(400, "request body is not valid JSON: nested too deeply")
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object")
    return body


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown routes and methods in the OpenAI error shape, as the server answers them."""
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404 and message == "Not Found":
        message = f"Not Found: no route {request.method} {request.url.path}"
    # Its headers too: a 405's Allow, a 408's Connection: close.
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


class Router:
    """The backend pools, the client that reaches them while the app runs, and the handlers;
    ``app`` is the FastAPI app serving them. ``transport``: an httpx transport for the backend
    client (tests mock it)."""

    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None):
        config.validate()
        self.config = config
        self.prefill = BackendPool.of("prefill", config.prefill_urls)
        self.decode = BackendPool.of("decode", config.decode_urls)
        self.pools: dict[str, BackendPool] = {"prefill": self.prefill, "decode": self.decode}
        if not config.prefill_urls:  # replicas only: each decode server computes the whole request
            del self.pools["prefill"]
        if config.policy == "prefix":
            # Per pool: a prompt's KV lives where it was computed (prefill), or on the replica.
            for pool in self.pools.values():
                pool.index = PrefixIndex(config.prefix_index_size)
                pool.load_threshold = config.load_threshold
        self._transport = transport
        self._client: httpx.AsyncClient | None = None  # only while the app runs (its lifespan)
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="tpuserve router", lifespan=self._lifespan)
        app.state.pools = self.pools
        app.add_middleware(BodyDeadlineMiddleware, timeout_s=self.config.http_body_timeout_s)
        app.exception_handler(StarletteHTTPException)(_http_error)
        routes = (
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/chat/completions", self.chat_completions),
            ("GET", "/v1/models", self.models),
            # The servers' utility routes: token ids are the same on every server of one model.
            ("POST", "/tokenize", self.tokenize),
            ("POST", "/detokenize", self.detokenize),
            ("GET", "/metrics", self.metrics),
            ("GET", "/health", self.health),
            ("GET", "/router/backends", self.backends),
        )
        for method, path, endpoint in routes:
            app.add_api_route(path, endpoint, methods=[method])
        return app

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the router's backend client exists only while its app runs")
        return self._client

    # ---- health ----

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(
            transport=self._transport,
            limits=limits,
            timeout=httpx.Timeout(self.config.prefill_timeout_s, connect=self.config.connect_timeout_s),
        )
        task = asyncio.create_task(self._health_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self._client.aclose()
            self._client = None

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # never let the checker die
                log.exception("health check failed")
            await asyncio.sleep(self.config.health_interval_s)

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(p, b) for p in self.pools.values() for b in p.backends))

    async def _check(self, pool: BackendPool, b: Backend) -> None:
        try:
            r = await self.client.get(b.url + "/health", timeout=self.config.health_timeout_s)
            err = None if r.status_code == 200 else f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            err = f"/health failed: {type(e).__name__}: {e}"
        pool.mark(b, err)

    # ---- completions: prefill, then decode ----

    async def completions(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/chat/completions")

    async def _proxy(self, request: Request, path: str) -> Response:
        body = await _json_object(request)
        if isinstance(body, Response):
            return body
        headers = _forward_headers(request)
        hashes = (
            chunk_hashes(prefix_key(body), self.config.prefix_chunk_chars)
            if self.config.policy == "prefix"
            else []
        )
        try:
            if "prefill" not in self.pools:  # replicas: the decode server runs the whole request
                kv_params = body.get("kv_transfer_params")
            else:
                kv_params = await self._prefill(path, body, headers, hashes)
            stream = bool(body.get("stream"))
            d, release = await self._send(
                self.decode,
                path,
                _decode_body(body, kv_params) if "prefill" in self.pools else body,
                headers,
                stream=stream,
                read_timeout=self.config.decode_read_timeout_s,
                hashes=hashes,
            )
        except _ClientError as e:
            r = e.response
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        except UpstreamError as e:
            return error_response(e.status, e.message)
        if not stream:
            release()
            return Response(d.content, d.status_code, media_type=d.headers.get("content-type"))
        if d.status_code != 200:
            try:
                content = await d.aread()
            finally:
                await d.aclose()
                release()
            return Response(content, d.status_code, media_type=d.headers.get("content-type"))
        return _RelayResponse(
            _relay(d), release, status_code=200, media_type=d.headers.get("content-type", "text/event-stream")
        )

    async def _prefill(self, path: str, body: dict, headers: dict, hashes: Sequence[bytes]) -> dict | None:
        """The prefill's kv_transfer_params; UpstreamError (a 4xx passed on as one) otherwise."""
        p, release = await self._send(
            self.prefill,
            path,
            _prefill_body(body, path),
            headers,
            stream=False,
            read_timeout=self.config.prefill_timeout_s,
            hashes=hashes,
        )
        release()
        if p.status_code != 200:
            if 400 <= p.status_code < 500:  # the request itself is bad: say so as the server did
                raise _ClientError(p)
            raise UpstreamError(502, f"prefill server answered {p.status_code}: {p.text[:500]}")
        try:
            return p.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise UpstreamError(502, "prefill server answered something that is not a JSON object") from None

    async def _send(
        self,
        pool: BackendPool,
        path: str,
        body: dict,
        headers: dict,
        stream: bool,
        read_timeout: float,
        hashes: Sequence[bytes] = (),
    ) -> tuple[httpx.Response, Callable[[], None]]:
        """POST to the first reachable healthy backend of ``pool``; UpstreamError if none is. Also
        returns the callback that ends the request's in-flight count there (call it once the
        answer is done with: read, relayed, or abandoned)."""
        role = pool.role
        tried: list[str] = []
        for b in pool.candidates(hashes):
            req = self.client.build_request(
                "POST",
                b.url + path,
                content=_json_bytes(body),
                headers={**headers, "content-type": "application/json"},
                timeout=httpx.Timeout(read_timeout, connect=self.config.connect_timeout_s),
            )
            b.in_flight += 1
            release = _releaser(b)
            try:
                resp = await self.client.send(req, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as e:
                # Refused, unreachable, or closed before answering: nothing ran there; try the next.
                release()
                pool.mark(b, f"{type(e).__name__}: {e}")
                tried.append(f"{b.url}: {type(e).__name__}")
                continue
            except httpx.TimeoutException as e:
                release()
                pool.mark(b, f"{type(e).__name__}: {e}")
                raise UpstreamError(
                    504 if role == "prefill" else 502, f"{role} server {b.url} timed out ({type(e).__name__})"
                ) from None
            except httpx.HTTPError as e:
                release()
                raise UpstreamError(502, f"{role} server {b.url} failed: {type(e).__name__}: {e}") from None
            except BaseException:  # the client left (cancelled) while the backend was answering
                release()
                raise
            if pool.index is not None:
                pool.index.record(hashes, b.url)  # it computes (so caches) this prompt now
            b.requests += 1
            return resp, release
        if not tried:
            raise UpstreamError(
                503,
                f"no healthy {role} server "
                f"({', '.join(b.url + ': ' + str(b.last_error) for b in pool.backends)})",
            )
        raise UpstreamError(502, f"no {role} server reachable ({'; '.join(tried)})")

    # ---- routes a decode server answers alone ----

    async def models(self, request: Request) -> Response:
        return await self._to_decode(request, "GET", "/v1/models")

    async def tokenize(self, request: Request) -> Response:
        return await self._to_decode(request, "POST", "/tokenize")

    async def detokenize(self, request: Request) -> Response:
        return await self._to_decode(request, "POST", "/detokenize")

    async def _to_decode(self, request: Request, method: str, path: str) -> Response:
        """One request to the first reachable decode server, answered as it answered."""
        content: bytes | None = None
        headers = _forward_headers(request)
        if method == "POST":
            body = await _json_object(request)
            if isinstance(body, Response):
                return body
            try:
                content = _json_bytes(body)
            except UpstreamError as e:
                return error_response(e.status, e.message)
            headers["content-type"] = "application/json"
        for b in self.decode.candidates():
            try:
                r = await self.client.request(method, b.url + path, content=content, headers=headers)
            except httpx.HTTPError as e:
                self.decode.mark(b, f"{type(e).__name__}: {e}")
                continue
            b.requests += 1
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return error_response(503, "no healthy decode server")

    # ---- the router's own state ----

    async def metrics(self) -> Response:
        """The router's own: each backend's health and the requests sent to it."""
        lines = [
            "# HELP tpuserve_router_backend_healthy Whether the router routes to the backend.",
            "# TYPE tpuserve_router_backend_healthy gauge",
            "# HELP tpuserve_router_backend_requests_total Requests the router sent it.",
            "# TYPE tpuserve_router_backend_requests_total counter",
            "# HELP tpuserve_router_backend_in_flight Requests sent to it and not yet answered in full.",
            "# TYPE tpuserve_router_backend_in_flight gauge",
            "# HELP tpuserve_router_backend_prefix_hits_total Requests routed to it for a prefix it held.",
            "# TYPE tpuserve_router_backend_prefix_hits_total counter",
        ]
        for role, pool in self.pools.items():
            for b in pool.backends:
                labels = f'role="{role}",url="{b.url}"'
                lines.append(f"tpuserve_router_backend_healthy{{{labels}}} {int(b.healthy)}")
                lines.append(f"tpuserve_router_backend_requests_total{{{labels}}} {b.requests}")
                lines.append(f"tpuserve_router_backend_in_flight{{{labels}}} {b.in_flight}")
                lines.append(f"tpuserve_router_backend_prefix_hits_total{{{labels}}} {b.prefix_hits}")
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def health(self) -> Response:
        missing = [role for role, pool in self.pools.items() if not any(b.healthy for b in pool.backends)]
        if missing:
            return error_response(503, f"no healthy {' or '.join(missing)} server")
        return Response(status_code=200)

    async def backends(self) -> JSONResponse:
        return JSONResponse(
            {
                role: [
                    {
                        "url": b.url,
                        "healthy": b.healthy,
                        "last_error": b.last_error,
                        "requests": b.requests,
                        "in_flight": b.in_flight,
                        "prefix_hits": b.prefix_hits,
                    }
                    for b in pool.backends
                ]
                for role, pool in self.pools.items()
            }
        )


class _ClientError(Exception):
    """A backend's 4xx to pass on as it is: the request itself is bad."""

    def __init__(self, response: httpx.Response):
        super().__init__(response.status_code)
        self.response = response


def _releaser(b: Backend) -> Callable[[], None]:
    """Ends one request's in-flight count on ``b``, once however many paths call it."""
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            b.in_flight -= 1

    return release


class _RelayResponse(StreamingResponse):
    """A relayed stream that ends the in-flight count however it ends: completed, broken, or the
    client gone (Starlette then cancels the send, and the generator may never be closed)."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None], **kw) -> None:
        super().__init__(content, **kw)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


async def _relay(d: httpx.Response) -> AsyncIterator[bytes]:
    """A streamed decode answer, chunk by chunk; an OpenAI error event if it breaks off."""
    try:
        async for chunk in d.aiter_bytes():  # decoded: the relay sends no content-encoding
            yield chunk
    except httpx.HTTPError as e:  # the decode server died or stalled mid-stream: tell the client
        log.warning("decode stream from %s broke: %s", d.request.url, e)
        err = {
            "error": {
                "message": f"decode server failed mid-stream: {type(e).__name__}",
                "type": "BadGatewayError",
                "param": None,
                "code": 502,
            }
        }
        yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        await d.aclose()


def build_router_app(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The FastAPI app of a ``Router`` over ``config`` (``transport``: see ``Router``)."""
    return Router(config, transport).app


# ---- CLI (``tpuserve router``; tpuserve/cli.py calls add_router_parser) ----


def add_router_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("router", help="OpenAI-compatible proxy over prefill and decode servers")
    parser.add_argument(
        "--prefill",
        action="extend",
        nargs="+",
        default=[],
        metavar="URL",
        help="prefill server URL(s) (repeatable); none: the decode servers are whole replicas",
    )
    parser.add_argument(
        "--decode",
        "--replica",
        dest="decode",
        action="extend",
        nargs="+",
        default=[],
        metavar="URL",
        help="decode server (or, without --prefill, replica) URL(s) (repeatable)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="round-robin",
        help="prefix: the backend holding the longest prefix of the prompt (an approximate index of "
        "what it was sent), unless it has more than --load-threshold requests in flight over the "
        "least loaded; round-robin: in turn",
    )
    parser.add_argument("--load-threshold", type=int, default=4)
    parser.add_argument("--prefix-chunk-chars", type=int, default=256)
    parser.add_argument("--prefix-index-size", type=int, default=65536)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--health-interval", type=float, default=5.0, help="seconds between /health polls")
    parser.add_argument("--connect-timeout", type=float, default=3.0)
    parser.add_argument(
        "--prefill-timeout", type=float, default=300.0, help="seconds a prefill answer may take"
    )
    parser.add_argument(
        "--decode-read-timeout",
        type=float,
        default=600.0,
        help="seconds a decode answer may go without sending anything",
    )
    add_deadline_args(parser)  # validated with the rest in RouterConfig.validate
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.set_defaults(func=run_router)
    return parser


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = RouterConfig(
        args.prefill,
        args.decode,
        health_interval_s=args.health_interval,
        connect_timeout_s=args.connect_timeout,
        prefill_timeout_s=args.prefill_timeout,
        decode_read_timeout_s=args.decode_read_timeout,
        http_header_timeout_s=args.http_header_timeout,
        http_body_timeout_s=args.http_body_timeout,
        policy=args.policy,
        prefix_chunk_chars=args.prefix_chunk_chars,
        prefix_index_size=args.prefix_index_size,
        load_threshold=args.load_threshold,
    )
    app = build_router_app(config)  # ValueError (bad URL, ...) -> the CLI's exit 2
    log.info(
        "routing on http://%s:%d: prefill %s, decode %s",
        args.host,
        args.port,
        config.prefill_urls,
        config.decode_urls,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        http=deadline_protocol(config.http_header_timeout_s, config.http_body_timeout_s),
    )
    return 0

"""Deadlines for reading an HTTP request, so that slow or stalled clients cannot hold connections.

uvicorn bounds only the idle time between keep-alive requests; a client that sends half a request
head (slowloris) or half a body and then waits would keep its connection, and a task, forever. Two
pieces, used by ``tpuserve serve`` and ``tpuserve router``:

* ``deadline_protocol(header_timeout_s, body_timeout_s)``: uvicorn's h11 protocol with two timers.
  The request head must be complete ``header_timeout_s`` after the connection opened (first
  request) or after its first byte arrived (later keep-alive requests); else the connection is
  closed. A body still incomplete ``body_timeout_s`` (+ a grace second) after its head is closed too:
  that catches bodies the app never reads (a 401 or 404 answered before the body came).
* ``BodyDeadlineMiddleware``: while the app reads the body, a body not all received within
  ``body_timeout_s`` of the head gets a 408 in the OpenAI error shape (``Connection: close``).

Only reading the request is bounded: once it is in, nothing here limits how long the answer takes
or how slowly the client reads a streamed answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
# The protocol's body timer closes the connection this long after the middleware's 408 was due, so
# that a client whose body the app is reading gets the 408 rather than a bare close.
_BODY_BACKSTOP_GRACE_S = 1.0


def add_deadline_args(parser, value_type=float) -> None:
    """``--http-header-timeout`` and ``--http-body-timeout`` on an argparse parser (serve, router)."""
    parser.add_argument(
        "--http-header-timeout",
        type=value_type,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a client has to send a whole request head, from connecting (or "
        "from the first byte of a later keep-alive request); then the connection "
        f"is closed (default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--http-body-timeout",
        type=value_type,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a client has to send a whole request body after its head; then "
        "it gets a 408 and the connection is closed. Only reading the request is "
        f"bounded, never a (streamed) answer (default {DEFAULT_BODY_TIMEOUT_S:g})",
    )


def check_timeouts(header_timeout_s: float, body_timeout_s: float) -> None:
    for name, value in (("--http-header-timeout", header_timeout_s), ("--http-body-timeout", body_timeout_s)):
        if not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive finite number of seconds, got {value}")


class BodyDeadlineMiddleware:
    """ASGI middleware: the app's ``receive`` raises HTTPException(408) once the request body has not
    all arrived ``timeout_s`` after the app was called (the head's arrival). FastAPI re-raises it
    from body parsing and the app's HTTPException handler answers it in the OpenAI error shape."""

    def __init__(self, app: Any, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False

        async def bounded_receive() -> dict:
            nonlocal body_done
            if body_done:
                # Later receives only wait for the client to leave (e.g. during a long streamed
                # answer): never bounded.
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except TimeoutError:
                from starlette.exceptions import HTTPException

                raise HTTPException(
                    408,
                    f"the request body did not arrive within {self.timeout_s:g} s",
                    headers={"connection": "close"},
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, bounded_receive, send)


def deadline_protocol(header_timeout_s: float, body_timeout_s: float) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's h11 protocol closing connections whose request head (body) has not
    arrived in time; pass it as ``uvicorn.Config(http=...)``. (Selecting it also means h11 is used
    even where httptools is installed: the timers hook into the h11 connection's state.)"""
    check_timeouts(header_timeout_s, body_timeout_s)
    # Imported here: the CLI imports this module for every command; uvicorn is only for serving.
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _body_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # The first head is due this long after connecting (a client that connects and sends
            # nothing is cut too).
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_too_slow)

        def data_received(self, data: bytes) -> None:
            # The first byte of a later keep-alive request starts that head's deadline (until then,
            # uvicorn's keep-alive timeout bounds the idle connection).
            if self.conn.their_state is h11.IDLE and self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_too_slow)
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            state = self.conn.their_state
            if state is not h11.IDLE:
                self._cancel_head_timer()
            if state is h11.SEND_BODY:
                if self._body_timer is None:
                    self._body_timer = self.loop.call_later(
                        body_timeout_s + _BODY_BACKSTOP_GRACE_S, self._body_too_slow
                    )
            else:
                self._cancel_body_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            self._cancel_body_timer()
            super().connection_lost(exc)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _cancel_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _close(self, why: str) -> None:
            if not self.transport.is_closing():
                log.debug("closing the connection from %s: %s", self.client, why)
                self.transport.close()

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE:
                self._close(f"no complete request head within {header_timeout_s:g} s")

        def _body_too_slow(self) -> None:
            self._body_timer = None
            if self.conn.their_state is h11.SEND_BODY:
                self._close(f"no complete request body within {body_timeout_s:g} s")

    return DeadlineH11Protocol

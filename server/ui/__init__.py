"""The built-in page of ``tpuserve serve``: a chat playground and a live view of the server's metrics.

Three static files (index.html, app.js, app.css) ship in this package and are served as they are: no
build step, nothing fetched from elsewhere. The page talks to the server only through its public API
(/v1/models, /v1/chat/completions with ``stream``) and /metrics, sending the API key, when the server
has one, as ``Authorization: Bearer`` like any other client. The files themselves hold no data, so
they are served without the key: that is what lets the page ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

_HERE = Path(__file__).parent

# Scripts and styles only from this server, none inline, no frames: a chat answer that contains
# markup can never run (the page also only ever writes answers as text).
_SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    # A new version of tpuserve must never run against an old cached script.
    "cache-control": "no-cache",
}


@dataclass(frozen=True)
class UIFile:
    path: str  # URL path
    filename: str  # in this package
    media_type: str


UI_FILES = (
    UIFile("/", "index.html", "text/html; charset=utf-8"),
    UIFile("/ui/app.js", "app.js", "text/javascript; charset=utf-8"),
    UIFile("/ui/app.css", "app.css", "text/css; charset=utf-8"),
)

# Paths that answer without the API key when the page is on.
UI_PATHS = frozenset(f.path for f in UI_FILES)


def add_ui_routes(app: FastAPI) -> None:
    """Serve the page's files from ``app`` (read once, here: they are a few tens of KB)."""
    for f in UI_FILES:
        _add_file_route(app, f.path, (_HERE / f.filename).read_bytes(), f.media_type)


def _add_file_route(app: FastAPI, path: str, body: bytes, media_type: str) -> None:
    async def serve_file() -> Response:
        return Response(body, media_type=media_type, headers=_SECURITY_HEADERS)

    app.add_api_route(path, serve_file, methods=["GET"], include_in_schema=False, name=f"ui:{path}")

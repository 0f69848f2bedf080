"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status."""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi.responses import JSONResponse

# Named as the official openai client names its exception classes (what vLLM sends too).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


# Seconds a client should wait before retrying a 503 (overload, engine starting or stopping).
RETRY_AFTER_S = 1


class APIError(Exception):
    """Raise from a handler to answer ``status`` with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def param_of(message: str) -> str | None:
    """The parameter a ValueError message starts with ("top_p must be ..." -> "top_p")."""
    head = message.split(" ", 1)[0].rstrip(":,")
    return head if head.replace("_", "").replace(".", "").isalnum() else None


def _printable(text: str | None) -> str | None:
    """Messages may quote client input; a lone surrogate there would make the UTF-8 encoder of the
    response fail (a 500 in place of the intended error), so escape it."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None) -> dict:
    err_type = ERROR_TYPES.get(status)
    if err_type is None:
        try:
            words = re.sub(r"[^A-Za-z ]", "", HTTPStatus(status).phrase).split()
            err_type = "".join(w[:1].upper() + w[1:] for w in words) + "Error"
        except ValueError:
            err_type = "Error"
    return {
        "error": {
            "message": _printable(message),
            "type": err_type,
            "param": _printable(param),
            "code": status,
        }
    }


def error_headers(status: int, headers: dict | None = None) -> dict | None:
    """``headers`` plus, on a 503, the ``Retry-After`` every 503 must carry."""
    if status != 503 or any(k.lower() == "retry-after" for k in headers or {}):
        return headers
    return {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param), status_code=status, headers=error_headers(status, headers)
    )

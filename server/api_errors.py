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


def error_body(status: int, message: str, param: str | None = None) -> dict:
    err_type = ERROR_TYPES.get(status)
    if err_type is None:
        try:
            words = re.sub(r"[^A-Za-z ]", "", HTTPStatus(status).phrase).split()
            err_type = "".join(w[:1].upper() + w[1:] for w in words) + "Error"
        except ValueError:
            err_type = "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

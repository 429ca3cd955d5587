"""Every error a channel sends: `{"error": {"code", "message"}}` with a 4xx status."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from harness.errors import Conflict, InvalidInput, KeelError, Limited, NotFound, Unavailable

_enc = msgspec.json.Encoder()
_STATUS: list[tuple[type[KeelError], int]] = [
    (InvalidInput, 400),
    (NotFound, 404),
    (Conflict, 409),
    (Limited, 429),
    (Unavailable, 503),
]
# Storage unavailable for a moment: a 503 the client retries (a repeated message_id or answer
# is safe), with Retry-After, rather than an opaque 500.
RETRY_AFTER = {"Retry-After": "1"}
_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    415: "unsupported_media_type",
}


class ChannelError(KeelError):
    """An error with its HTTP status, raised by the channel itself."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message, code=code)
        self.status = status


def error_body(code: str, message: str, details: Mapping[str, str] | None = None) -> bytes:
    return _enc.encode({"error": {"code": code, "message": message, **(details or {})}})


def error_response(
    status: int,
    code: str,
    message: str,
    headers: Mapping[str, str] | None = None,
    details: Mapping[str, str] | None = None,
) -> Response:
    body = error_body(code, message, details)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


async def keel_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, KeelError)
    if isinstance(exc, ChannelError):
        return error_response(exc.status, exc.code, exc.message)
    status = next((s for cls, s in _STATUS if isinstance(exc, cls)), 400)
    headers = RETRY_AFTER if isinstance(exc, Unavailable) else None
    if isinstance(exc, Limited):  # the client may come back after this long
        headers = {"Retry-After": str(exc.retry_after)}
    return error_response(status, exc.code, exc.message, headers=headers, details=exc.details)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(
        exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail), headers=exc.headers
    )

"""Request ids as pure ASGI middleware (BaseHTTPMiddleware would break contextvars).

Every HTTP request and websocket gets an id: the caller's `X-Request-ID` when it is a sane one
(1-128 of `A-Z a-z 0-9 . _ : -`, so nothing odd reaches a log line), else a new `req_...` (a
random prefix per process and a counter). It is
echoed in the response's `X-Request-ID` header and set, with the session id the path names, in
the context variables log lines carry (`harness.telemetry.logcontext`)."""

from __future__ import annotations

import itertools
import os
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from harness.telemetry.logcontext import request_id, session_id

VALID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
HEADER = b"x-request-id"
SESSIONS = "/v1/sessions/"
_PREFIX = "req_" + os.urandom(6).hex()  # this process's, then a counter: unique, and cheaper than an id
_counter = itertools.count(1)


class RequestIds:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == HEADER), None)
        rid = given.decode() if given is not None and VALID.match(given) else f"{_PREFIX}{next(_counter):x}"
        request_id.set(rid)
        path: str = scope.get("path", "")
        session_id.set(path[len(SESSIONS) :].partition("/")[0] or None if path.startswith(SESSIONS) else None)
        echoed = (HEADER, rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message["headers"] = [*message.get("headers", ()), echoed]
            await send(message)

        await self.app(scope, receive, send_with_id)

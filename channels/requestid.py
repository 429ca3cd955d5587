"""Request ids, given by the front door (`channels.front`).

Every HTTP request and websocket gets an id: the caller's `X-Request-ID` when it is a sane one
(1-128 of `A-Z a-z 0-9 . _ : -`, so nothing odd reaches a log line), else a new `req_...` (a
random prefix per process and a counter). It is
echoed in the response's `X-Request-ID` header and set, with the session id the path names, in
the context variables log lines carry (`harness.telemetry.logcontext`)."""

from __future__ import annotations

import itertools
import os
import re

from starlette.types import Message, Scope, Send

from harness.telemetry.logcontext import request_id, session_id

VALID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
HEADER = b"x-request-id"
SESSIONS = "/v1/sessions/"
_PREFIX = "req_" + os.urandom(6).hex()  # this process's, then a counter: unique, and cheaper than an id
_counter = itertools.count(1)


def assign(scope: Scope) -> tuple[bytes, bytes]:
    """The request's id, set in the log context with the session id its path names: the
    response header that echoes it."""
    given = None
    for k, v in scope["headers"]:
        if k == HEADER:
            given = v
            break
    rid = given.decode() if given is not None and VALID.match(given) else f"{_PREFIX}{next(_counter):x}"
    request_id.set(rid)
    path: str = scope.get("path", "")
    session_id.set(path[len(SESSIONS) :].partition("/")[0] or None if path.startswith(SESSIONS) else None)
    return (HEADER, rid.encode())


def echoed(send: Send, header: tuple[bytes, bytes]) -> Send:
    """`send` with the request id's header added to the response's start (or the socket's accept)."""

    async def send_with_id(message: Message) -> None:
        if message["type"] in ("http.response.start", "websocket.accept"):
            message["headers"] = [*message.get("headers", ()), header]
        await send(message)

    return send_with_id

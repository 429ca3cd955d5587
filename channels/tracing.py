"""The HTTP request's span: the server span every other span of a request is a child of.

An ASGI middleware, put in front only when tracing is on (`harness.telemetry.tracing`): its
span is named for the method and the route (ids in the path as `{id}`), a child of the
request's W3C `traceparent` header when it has one, and holds the request until its response
ends (an SSE stream's span lasts as long as the stream). A message the request sends is stored
with this span's traceparent: its turn's spans join the trace wherever the turn runs.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from harness.telemetry import tracing

_ID = re.compile(r"(?<=/)[a-z]+_[0-9a-z]{26}(?=/|$)")  # a keel id in a path: ses_..., wh_...


def route_of(path: str) -> str:
    """The path with keel's ids as `{id}` (a span name stays the same for every session)."""
    return _ID.sub("{id}", path)


class TraceRequests:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        parent = next((v for k, v in scope["headers"] if k == b"traceparent"), b"").decode("latin-1")
        method, route = scope["method"], route_of(scope["path"])
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        attributes = {"http.request.method": method, "http.route": route, "url.path": scope["path"]}
        with tracing.span(f"{method} {route}", attributes, parent=parent.strip(), server=True) as span:
            await self.app(scope, receive, sending)
            tracing.record(span, {"http.response.status_code": status})
            if status >= 500:
                tracing.failed(span, str(status))

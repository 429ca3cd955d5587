"""The front door: what every HTTP request and websocket passes before its route, as one pure
ASGI layer (BaseHTTPMiddleware would break contextvars).

In order: its id (`channels.requestid`: set in the log context, echoed in `X-Request-ID`), the
drain (`channels.drain`: 503 `draining`, or close 1012, once it began), CORS for the frontend
protocols' routes (`channels.cors`: a preflight answered before any key is asked for), and the
API key (`channels.auth`, the layer this one hands to: 401, else the request's owner in its
state). Two layers rather than four: each layer of a request's stack is a frame that every
resumption of the request's task goes through again (a `?wait=true` message resumes it twice),
and the four cost about 15 us a turn under load against 220 (`docs/benchmarks.md`, "keel's HTTP
layer alone").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from channels import requestid
from channels.auth import ApiKeyAuth
from channels.cors import frontend, frontend_cors
from channels.drain import Drain
from channels.drain import refuse as refuse_draining


class Front:
    def __init__(
        self,
        app: ASGIApp,
        *,
        drain: Drain,
        origins: Sequence[str] = (),
        keys: Iterable[str] = (),
        open_paths: Iterable[str] = (),
        guarded: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.drain = drain
        self.keyed = ApiKeyAuth(app, keys, open_paths, guarded)
        self.cors = frontend_cors(self.keyed, origins)  # (None without origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        send = requestid.echoed(send, requestid.assign(scope))
        if not self.drain.let_in(scope["path"]):
            await refuse_draining(kind, receive, send)
            return
        inner: ASGIApp = self.keyed
        if self.cors is not None and kind == "http" and frontend(scope["path"]):
            inner = self.cors  # (a preflight answered there, before any key is asked for)
        try:
            await inner(scope, receive, send)
        finally:
            self.drain.left()

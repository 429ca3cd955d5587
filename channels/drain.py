"""A process's drain as its clients see it (SIGTERM; docs/production.md "Process lifecycle").

Once it begins: `/readyz` and every new request answer 503 `draining` with `Retry-After` (the
load balancer, or the client, goes to another process), new websockets are closed with 1012,
open SSE streams end cleanly and open websockets close with 1012 (the client reconnects
elsewhere with its last event id and misses nothing). `/healthz` and `/metrics` still answer.
`Drain` is the state, which the front door (`channels.front`) keeps and answers by; the app's
server begins the drain and waits for `settled`."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import Receive, Send

from channels.errors import error_body

OPEN_PATHS = frozenset({"/healthz", "/metrics"})  # still served while draining
RETRY_AFTER_S = 1
RESTART = 1012  # websocket close code: the service is restarting (reconnect)


class Drain:
    def __init__(self) -> None:
        self.begun = asyncio.Event()
        self.open = 0  # requests and websockets let through and not yet ended
        self.refused = 0  # requests answered 503 draining
        self._last = 0.0  # (loop time) the last request that came, once draining

    @property
    def draining(self) -> bool:
        return self.begun.is_set()

    def begin(self) -> None:
        self._last = asyncio.get_running_loop().time()
        self.begun.set()

    def let_in(self, path: str) -> bool:
        """A request or websocket came for `path`: whether it goes through (then it counts as
        open until the front door calls `left`), or is refused (the drain began)."""
        if self.begun.is_set():
            self._last = asyncio.get_running_loop().time()
            if path not in OPEN_PATHS:
                self.refused += 1
                return False
        self.open += 1
        return True

    def left(self) -> None:
        self.open -= 1

    async def settled(self, quiet: float, deadline: float) -> bool:
        """Once nothing let through is open any more and no request came for `quiet` seconds
        (clients still arriving get their 503 rather than a refused connection), or at
        `deadline` (loop time). False if the deadline came first."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if self.open == 0 and now - self._last >= quiet:
                return True
            if now >= deadline:
                return False
            await asyncio.sleep(min(0.05, deadline - now))


async def refuse(kind: str, receive: Receive, send: Send) -> None:
    """A request (`kind` "http") or websocket that came once the drain began: 503 `draining`,
    or close 1012. The front door (`channels.front`) sends it."""
    await (_refuse(send) if kind == "http" else _close(receive, send))


async def _refuse(send: Send) -> None:
    body = error_body("draining", "this process is shutting down; retry (another process will answer)")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _close(receive: Receive, send: Send) -> None:
    """A websocket that comes during the drain: accepted and closed with 1012 at once (a browser
    sees a close code only on an accepted socket)."""
    with contextlib.suppress(Exception):  # (the client may be gone already)
        if (await receive())["type"] == "websocket.connect":
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": RESTART, "reason": "the server is restarting; reconnect"})

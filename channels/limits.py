"""What one client may hold open in this process: readers per session (SSE streams and
websockets together), websockets per session token. Counted here, not in Redis: the point is
this process's memory and sockets, and a count in Redis would outlive a process killed with -9."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from harness.errors import Limited


class Occupancy:
    def __init__(self, cap: int, what: str, code: str) -> None:
        self.cap, self.what, self.code = cap, what, code
        self.held: dict[str, int] = {}

    def take(self, key: str) -> None:
        """One place for `key`, or Limited (`code`) when all `cap` are taken."""
        n = self.held.get(key, 0)
        if n >= self.cap:
            raise Limited(f"{self.cap} {self.what} are open already", code=self.code, retry_after=5)
        self.held[key] = n + 1

    def give(self, key: str) -> None:
        n = self.held.pop(key, 0)
        if n > 1:
            self.held[key] = n - 1


class HeldStream(StreamingResponse):
    """A streaming response that gives its place back however it ends (even if it never began)."""

    def __init__(self, content: Any, on_end: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()

"""Server-sent events: replay a session's outbox after a given id, then follow it live.

`id:` is the event id (a Redis stream id), `event:` its type, `data:` the envelope. A client
resumes with `Last-Event-ID` (EventSource does this itself) or `?after=`; a comment line is sent
as a heartbeat when nothing happened for a while. The stream ends (cleanly) when the process
drains (the client reconnects, to another process, after its last event) or when the session
does: `event: session.deleted` (no `id:`) is then its last event (EventSource's reconnection then
gets 404, and stops)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from channels.drain import Drain
from channels.http import NOT_FOUND, harness_of, owner_of
from channels.limits import HeldStream, Occupancy
from channels.spec import Param, Returns, operation
from harness import failpoints
from harness.events import LiveEvent

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class SseStats:
    """This process's event streams (for /metrics)."""

    open: int = 0


EVENT_ID = {"type": "string", "pattern": "^[0-9]{1,20}-[0-9]{1,20}$"}


@operation(
    "The session's events: replayed, then live (server-sent events)",
    Returns(
        200,
        str,
        "`id:` the event id, `event:` its type, `data:` the envelope (`Event`, or a `MessageDelta` without "
        "`id:`); a `:` comment line as a heartbeat. The stream ends when the process drains (reconnect "
        "with Last-Event-ID) or when the session does: its last event is then `session.deleted` "
        "(`SessionDeleted`, without `id:`).",
        media="text/event-stream",
    ),
    errors={**NOT_FOUND, 400: "`invalid_event_id`", 429: "`too_many_readers` of this session (Retry-After)"},
    params=(
        Param("after", EVENT_ID, "Replay after this event id"),
        Param("Last-Event-ID", EVENT_ID, "As `after` (EventSource sends it); the newer of the two wins", "header"),
    ),
)
async def stream_events(request: Request) -> Response:
    sid = request.path_params["sid"]
    harness = harness_of(request)
    # EventSource reconnects to the same URL with Last-Event-ID: resume from the newer of the two.
    after = harness.sessions.resume_after(request.query_params.get("after"), request.headers.get("last-event-id"))
    await harness.sessions.check_owner(sid, owner_of(request))
    heartbeat: float = request.app.state.sse_heartbeat
    stats: SseStats = request.app.state.sse_stats

    async def body() -> AsyncIterator[bytes]:
        stats.open += 1
        try:
            yield b"retry: 2000\n\n"
            async for event in harness.sessions.tail(sid, after, heartbeat=heartbeat):
                if event is None:
                    yield b": keep-alive\n\n"
                elif isinstance(event, LiveEvent):  # transient: no id, so Last-Event-ID stays put
                    yield b"event: %s\ndata: %s\n\n" % (event.type.encode(), event.raw)
                else:
                    yield b"id: %s\nevent: %s\ndata: %s\n\n" % (event.id.encode(), event.type.encode(), event.raw)
                    failpoints.reached("outbox.after_publish")
        finally:
            stats.open -= 1

    readers: Occupancy = request.app.state.readers
    readers.take(sid)  # (429 too_many_readers when the session has its fill of them here)
    on_end = functools.partial(readers.give, sid)
    drain: Drain = request.app.state.drain
    return EventStream(body(), on_end, drain, media_type="text/event-stream", headers=HEADERS)


class EventStream(HeldStream):
    """An event stream that ends, cleanly (its last chunk sent), when the process drains."""

    def __init__(self, content: Any, on_end: Callable[[], None], drain: Drain, **kw: Any) -> None:
        super().__init__(content, on_end, **kw)
        self.drain = drain
        self.drained = False

    async def listen_for_disconnect(self, receive: Receive) -> None:
        """The client went away, or the process drains: either ends the stream (Starlette then
        cancels the task writing it)."""
        left = asyncio.ensure_future(super().listen_for_disconnect(receive))
        drained = asyncio.ensure_future(self.drain.begun.wait())
        try:
            done, _ = await asyncio.wait((left, drained), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            drained.cancel()
        self.drained = left not in done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        await super().__call__(scope, receive, sending)
        if self.drained:  # (whole chunks went out, or none: a write is not cut in the middle)
            if not started:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

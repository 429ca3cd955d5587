"""The websocket channel: `GET /v1/sessions/{id}/ws[?after=<event id>][&token=...]`.

Server frames are the session's event envelopes, byte for byte as SSE sends them (same ids), in
outbox order, starting after `after` (from the first event without it): a client that
reconnects with the last id it saw misses nothing and sees nothing twice, across restarts too.
Besides them: `{"type": "error", "error": {"code", "message"}, "ref"}` for a bad frame (the
connection stays), `{"type": "heartbeat", "at"}` after `heartbeat` seconds without a frame,
and `{"type": "pong", "ref"}`. When the session is deleted (or found gone), the socket gets a
`session.deleted` frame (`SessionDeleted`) and is closed with 4404.

Client frames (JSON text): message, respond, cancel, compact, clear, ping (`channels.types`).

Close codes: 4401 no valid key or token, 4403 origin not allowed, 4404 unknown session (or
another owner's, or deleted while open), 4400 a bad `after`, 4429 the session has its fill of readers in this process
(or the token of websockets), 1009 a frame over the size limit, 1003 a binary frame,
1008 too many bad frames in a row, 1013 the client does not read fast enough (its send queue
stayed full), 1012 the server is restarting (its process drains: reconnect, to another process,
with the last event id).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from channels.answers import ErrorDetail, WsError, WsHeartbeat, WsPong
from channels.drain import RESTART, Drain
from channels.limits import Occupancy
from channels.spec import Param, Returns, operation
from channels.tokens import TokenSigner
from channels.types import WsCancel, WsClear, WsCompact, WsFrame, WsMessage, WsPing, WsRespond, ws_frame_decoder
from harness import Harness
from harness.aio import cancel_and_wait
from harness.errors import InvalidInput, KeelError, Limited, NotFound, Unavailable
from harness.telemetry.logcontext import request_id

log = logging.getLogger("keel.ws")
_enc = msgspec.json.Encoder()
MAX_BAD_FRAMES = 20  # in a row; then the connection is closed (1008)
CLOSE_WAIT_S = 10.0  # a close frame waits behind unsent frames; a client that reads none is dropped


@dataclass(frozen=True)
class WsConfig:
    max_frame: int = 65_536  # bytes of one client frame
    heartbeat: float = 15.0  # seconds without a server frame before a heartbeat frame
    send_queue: int = 256  # server frames waiting for a slow client ...
    slow_s: float = 10.0  # ... for at most this long before it is closed with 1013
    origins: tuple[str, ...] = ()  # allowed Origin values; () = same origin only; ("*",) = any


@dataclass
class WsStats:
    """Counters of this process's sockets (for tests, the load script and operators)."""

    open: int = 0
    closed: dict[int, int] = field(default_factory=dict)  # close code keel sent -> how many


class Closed(Exception):
    """The connection is to be closed with this code."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason[:120]


def origin_allowed(ws: WebSocket, origins: tuple[str, ...]) -> bool:
    """Browsers always send Origin; other clients need not. Without a list, only the page's own
    origin (the Host it connected to) may open a socket: a page elsewhere cannot ride a user's
    token or local access."""
    origin = ws.headers.get("origin")
    if origin is None or "*" in origins:
        return True
    if origins:
        return origin in origins
    host = ws.headers.get("host", "")
    return origin in (f"http://{host}", f"https://{host}")


@operation(
    "The session's websocket",
    Returns(101, None, "Switching protocols: events and frames as `x-websocket` says; closes as the docs list"),
    params=(
        Param("after", {"type": "string", "pattern": "^[0-9]{1,20}-[0-9]{1,20}$"}, "Replay after this event id"),
        Param("token", {"type": "string"}, "A token from `POST .../tokens` (browsers), instead of an API key"),
    ),
    websocket=(WsFrame, "WsServerFrame"),
    description="Close codes: 4401 no valid key or token, 4403 Origin not allowed, 4404 unknown session "
    "(or deleted while open: after a `session.deleted` frame), "
    "4400 a bad `after`, 4429 the session's readers or the token's sockets at their bound, "
    "1009 a frame too large, 1003 a binary frame, 1008 more than 20 bad frames in a row, "
    "1013 the client stopped reading or storage is briefly unavailable, 1012 the server is shutting down.",
)
async def session_socket(ws: WebSocket) -> None:
    harness: Harness = ws.app.state.harness
    config: WsConfig = ws.app.state.ws
    stats: WsStats = ws.app.state.ws_stats
    gate: asyncio.Semaphore = ws.app.state.ws_gate
    await ws.accept()  # first: a browser sees a close code only on an accepted socket
    stats.open += 1
    try:
        async with gate:  # a thousand sockets opening at once take turns at Redis
            sid, owner, after, token = await _admit(ws, harness, config, ws.app.state.tokens)
        with _held(ws.app.state.readers, sid), _held(ws.app.state.token_sockets, token):
            await Connection(ws, harness, config, sid, owner, gate=gate, drain=ws.app.state.drain).run(after)
    except Unavailable as exc:  # storage gone for a moment: the client reconnects after its last event
        log.warning("session socket: %s", exc.message)
        await _close(ws, stats, Closed(1013, "storage unavailable; reconnect"))
    except Closed as closed:
        await _close(ws, stats, closed)
    except WebSocketDisconnect:
        pass
    finally:
        stats.open -= 1


@contextlib.contextmanager
def _held(places: Occupancy, key: str | None) -> Iterator[None]:
    """A place for `key` (none needed without one) while the socket lives, or close 4429."""
    if key is None:
        yield
        return
    try:
        places.take(key)
    except Limited as exc:
        raise Closed(4429, exc.message) from None
    try:
        yield
    finally:
        places.give(key)


async def _close(ws: WebSocket, stats: WsStats, closed: Closed) -> None:
    stats.closed[closed.code] = stats.closed.get(closed.code, 0) + 1
    with contextlib.suppress(Exception):
        async with asyncio.timeout(CLOSE_WAIT_S):
            await ws.close(closed.code, closed.reason)


async def _admit(
    ws: WebSocket, harness: Harness, config: WsConfig, tokens: TokenSigner
) -> tuple[str, str, str, str | None]:
    """The session, its owner, where to resume, and the browser token the socket opened with
    (None with an API key)."""
    sid = ws.path_params["sid"]
    if not origin_allowed(ws, config.origins):
        raise Closed(4403, "origin not allowed")
    owner: str | None = ws.scope.get("state", {}).get("owner")
    token = ws.query_params.get("token") if owner is None else None
    if token is not None:
        owner = tokens.verify(token, sid)
    if owner is None:
        raise Closed(4401, "unauthorized")
    try:
        await harness.sessions.check_owner(sid, owner)
        after = harness.sessions.resume_after(ws.query_params.get("after"))
    except NotFound as exc:
        raise Closed(4404, exc.message) from None
    except InvalidInput as exc:
        raise Closed(4400, exc.message) from None
    return sid, owner, after, token


class Connection:
    """One socket: a reader (this task), a follower of the outbox and a writer, joined by a
    bounded queue of frames."""

    def __init__(
        self,
        ws: WebSocket,
        harness: Harness,
        config: WsConfig,
        sid: str,
        owner: str,
        *,
        gate: asyncio.Semaphore,
        drain: Drain,
    ) -> None:
        self.ws, self.harness, self.config, self.sid, self.owner = ws, harness, config, sid, owner
        self.gate = gate
        self.drain = drain
        self.queue: asyncio.Queue[str | bytes | Closed] = asyncio.Queue(config.send_queue)
        self.bad = 0
        self.rid = request_id.get() or ""  # the socket's (RequestIds); each frame's is <it>.<n>
        self.frames = 0

    async def run(self, after: str) -> None:
        follower = asyncio.create_task(self._follow(after))
        writer = asyncio.create_task(self._write())
        reader = asyncio.create_task(self._read())
        restart = asyncio.create_task(self._drained())
        tasks = (follower, writer, reader, restart)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # Closed, WebSocketDisconnect or an error: the socket ends
        finally:
            await cancel_and_wait(tasks)
            for task in tasks:  # the others' endings are read too (one ended it; theirs follow from it)
                if not task.cancelled():
                    task.exception()

    async def _drained(self) -> None:
        await self.drain.begun.wait()
        raise Closed(RESTART, "the server is restarting; reconnect")

    async def _follow(self, after: str) -> None:
        async for event in self.harness.sessions.tail(self.sid, after, heartbeat=self.config.heartbeat, gate=self.gate):
            frame = event.raw if event is not None else _enc.encode(WsHeartbeat(time.time()))
            await self._send(frame)
        # the session ended (its session.deleted was the last frame): the writer closes the
        # socket once every frame before it is out
        await self._send(Closed(4404, "session deleted"))
        await asyncio.Future()

    async def _send(self, frame: str | bytes | Closed) -> None:
        try:  # (asyncio.timeout: wait_for on 3.11 can swallow the cancellation that ends this task)
            async with asyncio.timeout(self.config.slow_s):
                await self.queue.put(frame)
        except TimeoutError:
            raise Closed(1013, "too slow: the client does not read its frames") from None

    async def _write(self) -> None:
        while True:
            frame = await self.queue.get()
            if isinstance(frame, Closed):
                raise frame
            if isinstance(frame, bytes):
                await self.ws.send_text(frame.decode())
            else:
                await self.ws.send_text(frame)

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            text = message.get("text")
            if text is None:
                raise Closed(1003, "frames are JSON text")
            if len(text) > self.config.max_frame:  # (uvicorn's ws_max_size usually stops it first)
                raise Closed(1009, f"a frame is larger than {self.config.max_frame} bytes")
            await self._handle(text)

    async def _handle(self, text: str) -> None:
        self.frames += 1
        request_id.set(f"{self.rid}.{self.frames}")
        ref = None
        try:
            frame: WsFrame = ws_frame_decoder.decode(text)
            ref = frame.ref
            await self._do(frame)
            self.bad = 0
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
            await self._error("invalid_frame", f"not a valid frame: {exc}", ref)
        except Unavailable as exc:
            log.warning("session %s: on a websocket frame: %s", self.sid, exc.message)
            await self._error("unavailable", "storage is unavailable; send the frame again", ref)
        except Limited as exc:  # not a bad frame: the client is told when to send it again
            await self._error(exc.code, exc.message, ref, retry_after=exc.retry_after, bad=False)
        except KeelError as exc:
            await self._error(exc.code, exc.message, ref)

    async def _do(self, frame: WsFrame) -> None:
        sessions, quotas, sid, owner = self.harness.sessions, self.harness.quotas, self.sid, self.owner
        match frame:
            case WsMessage(text=text, context=context, message_id=message_id, policy=policy):
                await sessions.admissible(sid, owner, message_id)  # (bad input spends no token)
                await quotas.admit(owner)
                await sessions.submit(sid, owner, text, context, message_id, policy=policy)
            case WsRespond(request_id=rid, decision=decision, reason=reason):
                await sessions.respond(sid, owner, rid, decision, reason)
            case WsCancel(turn_id=turn_id):
                await sessions.cancel(sid, owner, turn_id)
            case WsCompact():
                await sessions.admissible(sid, owner)
                await quotas.admit(owner)
                await sessions.compact(sid, owner)
            case WsClear():
                await sessions.clear(sid, owner)
            case WsPing(ref=ref):
                await self._send(_enc.encode(WsPong(ref)))

    async def _error(
        self, code: str, message: str, ref: str | None, *, retry_after: int | None = None, bad: bool = True
    ) -> None:
        self.bad += bad
        if self.bad > MAX_BAD_FRAMES:
            raise Closed(1008, "too many bad frames")
        await self._send(_enc.encode(WsError(ErrorDetail(code, message, retry_after), ref)))

"""A link to one Redis node: one connection, its replies parsed by hiredis.

The wire's pools hold links. `RespLink` is an asyncio protocol of its own: the commands of a
call go out in one write, and hiredis parses the replies as the bytes arrive, with no stream
reader, no per-reply coroutine and no timer per read or per call (one timer a link watches the
deadlines of the calls in flight). Calls may overlap on it (a pool shares one for every call
that does not block Redis): those that come while others are in flight go out together at the
loop's next turn, so a busy process writes and wakes once for many calls, not once for each.
Commands posted (sent, their replies not waited for: a cluster's lazy writes) go out as a
call's do. It speaks to a node over TCP or a Unix socket, with AUTH
and SELECT as the client's URL asks.
For what it does not speak (TLS, a credential provider, RESP3, a connection class of the
caller's) a pool uses `ClientLink`, the same calls over redis-py's own connection.

Error replies come back in their place as redis-py's exceptions (NOSCRIPT as NoScriptError,
a cluster's MOVED, ASK, TRYAGAIN and CLUSTERDOWN as theirs), never raised: a caller looks at
each reply. A link that shows data or end-of-file while idle (Redis restarted, say) is not
reused.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import hiredis
from hiredis import pack_command as _pack_one
from redis.asyncio.connection import AbstractConnection, Connection, UnixDomainSocketConnection
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)

# (error replies redis-py turns into classes of their own, by their first word)
_ERRORS: dict[str, Callable[[str], ResponseError]] = {
    "NOSCRIPT": NoScriptError,
    "MOVED": MovedError,
    "ASK": AskError,
    "TRYAGAIN": TryAgainError,
    "CLUSTERDOWN": ClusterDownError,
}


class _Reply(Exception):
    """An error reply as hiredis hands it over (then made the exception redis-py would give)."""


def error_of(message: str) -> ResponseError:
    code, _, rest = message.partition(" ")
    made = _ERRORS.get(code)
    return made(rest) if made is not None else ResponseError(message)


class Link(Protocol):
    """What a pool holds: `RespLink` or `ClientLink`."""

    @property
    def reusable(self) -> bool: ...

    async def usable(self) -> bool: ...

    async def call(self, data: bytes, count: int, deadline: float) -> list[Any]: ...

    async def close(self) -> None: ...


class _Call:
    __slots__ = ("count", "deadline", "future", "replies")

    def __init__(self, count: int, future: asyncio.Future[list[Any]], deadline: float) -> None:
        self.count = count  # the replies it waits for
        self.replies: list[Any] = []
        self.future = future
        self.deadline = deadline  # (loop time; inf: none of its own)


class RespLink(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = hiredis.Reader(replyError=_Reply)
        self._transport: asyncio.Transport | None = None
        self._calls: deque[_Call] = deque()  # in flight, in the order they were written
        self._out: list[bytes] = []  # calls' commands waiting for the next write
        self._soon = False  # the next write is at the loop's next turn
        self._broken = False  # data while idle, end-of-file, a failed or cut call: not reused
        # the deadlines' one timer: set for the earliest deadline in flight, or later (a call
        # that ended before its deadline leaves it set: when it fires, it looks again)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    # ---- the protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        calls = self._calls
        if not calls:  # (nothing asked: a link that speaks out of turn is done)
            self._broken = True
            return
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            call = calls[0]
            call.replies.append(error_of(str(reply)) if isinstance(reply, _Reply) else reply)
            if len(call.replies) == call.count:
                calls.popleft()
                if not call.future.done():  # (else its caller went away: the replies are let go)
                    call.future.set_result(call.replies)
                if not calls:
                    break

    def eof_received(self) -> bool:
        self._broken = True
        return False  # (the transport closes: connection_lost)

    def connection_lost(self, exc: Exception | None) -> None:
        self._broken = True
        self._transport = None
        calls, self._calls = self._calls, deque()
        for call in calls:
            if not call.future.done():
                call.future.set_exception(ConnectionError(f"Redis closed the connection: {exc or 'end of file'}"))

    # ---- the link ------------------------------------------------------------------------

    @property
    def reusable(self) -> bool:
        return not self._broken and self._transport is not None

    async def usable(self) -> bool:
        """Whether it may be used again (taken from a pool: nothing came while it was idle)."""
        return self.reusable

    async def call(self, data: bytes, count: int, deadline: float) -> list[Any]:
        """Write `data` (`count` commands), and the replies once all have come; TimeoutError
        at `deadline` (loop time), which breaks the link (and fails the calls after it). Calls
        may overlap: each one's commands go out in the order the calls came, in one write with
        those of the others that came meanwhile, and each gets its own replies. A caller that
        goes away (cancelled) leaves its replies to be read and let go."""
        call = self._send(data, count, deadline)
        if deadline < self._timer_at:
            self._watch(deadline)
        replies: list[Any] = await call.future
        return replies

    def post(
        self, data: bytes, count: int, done: Callable[[asyncio.Future[list[Any]]], None]
    ) -> asyncio.Future[list[Any]]:
        """`call` without waiting for it: the commands are written as a call's are (in their
        order among the calls on it: a call after them finds them run), and `done` gets the
        future of their replies. No deadline of their own: should Redis stop answering, the
        deadline of a call after them breaks the link, and fails them too."""
        future = self._send(data, count, math.inf).future
        future.add_done_callback(done)
        return future

    def _send(self, data: bytes, count: int, deadline: float) -> _Call:
        transport = self._transport
        if transport is None or self._broken:
            raise ConnectionError("the connection to Redis is closed")
        loop = asyncio.get_running_loop()
        call = _Call(count, loop.create_future(), deadline)
        if not self._calls and not self._out:
            transport.write(data)
        else:  # (others in flight: with the next write, at the loop's next turn)
            self._out.append(data)
            if not self._soon:
                self._soon = True
                loop.call_soon(self._flush)
        self._calls.append(call)
        return call

    def _flush(self) -> None:
        self._soon = False
        out, self._out = self._out, []
        if self._transport is not None and out:
            self._transport.write(b"".join(out))

    def _watch(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(at, self._expire)
        self._timer_at = at

    def _expire(self) -> None:
        """The timer: a call past its deadline fails with TimeoutError and breaks the link
        (its replies may still come: nothing after them can be trusted), which fails the calls
        after it; else the timer is set for the earliest deadline in flight."""
        self._timer, self._timer_at = None, math.inf
        if not self._calls:
            return
        now = asyncio.get_running_loop().time()
        late = next((c for c in self._calls if c.deadline <= now and not c.future.done()), None)
        if late is None:
            earliest = min(c.deadline for c in self._calls)
            if earliest < math.inf:
                self._watch(earliest)
            return
        late.future.set_exception(TimeoutError())
        self._broken = True
        if self._transport is not None:
            self._transport.abort()

    async def close(self) -> None:
        self._broken = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        if self._transport is not None:
            self._transport.abort()


async def open_resp(kwargs: dict[str, Any]) -> RespLink:
    """A link made as the client's settings say (host and port, or a Unix socket `path`; a
    password and username; a db), connected and handshaken. OSError if it cannot be made."""
    loop = asyncio.get_running_loop()
    connect_s = kwargs.get("socket_connect_timeout") or 5.0
    async with asyncio.timeout(connect_s):
        if kwargs.get("path"):
            _, link = await loop.create_unix_connection(RespLink, kwargs["path"])
        else:
            _, link = await loop.create_connection(RespLink, kwargs.get("host", "localhost"), kwargs.get("port", 6379))
        try:
            hello: list[tuple[Any, ...]] = []
            if kwargs.get("password"):
                user = kwargs.get("username")
                hello.append(("AUTH", user, kwargs["password"]) if user else ("AUTH", kwargs["password"]))
            if kwargs.get("db"):
                hello.append(("SELECT", kwargs["db"]))
            if kwargs.get("client_name"):
                hello.append(("CLIENT", "SETNAME", kwargs["client_name"]))
            if hello:
                for reply in await link.call(pack(hello), len(hello), loop.time() + connect_s):
                    if isinstance(reply, Exception):
                        raise ConnectionError(f"Redis refused the connection: {reply}")
        except BaseException:
            await link.close()
            raise
    return link


def speaks(make: type[AbstractConnection], kwargs: dict[str, Any]) -> bool:
    """Whether a `RespLink` can stand in for the client's connections: plain TCP or a Unix
    socket, RESP2, no credential provider."""
    plain = make in (Connection, UnixDomainSocketConnection)
    return plain and not kwargs.get("credential_provider") and kwargs.get("protocol") in (None, 2, "2")


class ClientLink:
    """A link over redis-py's connection, for what `RespLink` does not speak (TLS, say)."""

    def __init__(self, conn: AbstractConnection) -> None:
        self._conn = conn
        self._broken = False

    @property
    def reusable(self) -> bool:
        return not self._broken and self._conn.is_connected

    async def usable(self) -> bool:
        """Whether it may be used again (taken from a pool: nothing to read while it was idle)."""
        try:
            return self.reusable and not await self._conn.can_read()
        except ConnectionError:
            return False

    async def call(self, data: bytes, count: int, deadline: float) -> list[Any]:
        try:
            async with asyncio.timeout_at(deadline):
                await self._conn.send_packed_command(data, check_health=False)
                replies: list[Any] = []
                for _ in range(count):
                    try:
                        replies.append(await self._conn.read_response())
                    except ResponseError as exc:
                        replies.append(exc)
                return replies
        except BaseException:
            self._broken = True
            await self._conn.disconnect(nowait=True)
            raise

    async def close(self) -> None:
        self._broken = True
        await self._conn.disconnect(nowait=True)


def pack(commands: Sequence[Sequence[Any]]) -> bytes:
    """`commands` in the Redis protocol (RESP2 arrays of bulk strings), as redis-py packs them
    (hiredis's packer: bytes as they are, str as UTF-8, int and float by repr; anything else
    is a TypeError)."""
    return b"".join([_pack_one(c if type(c) is tuple else tuple(c)) for c in commands])

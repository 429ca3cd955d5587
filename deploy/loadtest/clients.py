"""The load generator's clients, lean enough not to starve the servers on a small machine: raw
asyncio streams for HTTP (deploy/bench/support.py's keep-alive `Conn`) and SSE, the
`websockets` client for sockets, msgspec to read events.

- `HttpClient`: POSTs a message (its own `message_id`), and follows its session's SSE stream on a
  connection of its own, which may be on another web process than the POSTs (as a load
  balancer would spread them); a turn ends when its `turn.completed` arrives on the stream.
- `WsClient`: sends message frames and reads the events on the same socket.

Each client runs one turn at a time, without pause (a closed loop). Latency: from just before
the message is sent to the arrival of its `turn.completed`. Errors: any answer but 202 (a 503
is retried after a second, on the next port, and counted apart), a websocket error frame or
close, an SSE stream that ends, a turn that does not complete within `TURN_TIMEOUT_S`.
`check` compares what a client saw with its session's outbox in Redis: every committed event
once, in order, none missing, and one `turn.completed` per message sent."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from deploy.bench.support import HOST, BenchError, Conn
from harness.events import SessionCreated, TurnCompleted
from harness.store.keys import SessionKeys

TURN_TIMEOUT_S = 30.0
CAUGHT_UP_TIMEOUT_S = 15.0


class Data(msgspec.Struct):
    message_id: str | None = None


class Event(msgspec.Struct):
    """What the clients read of an envelope (or of a websocket's error frame)."""

    type: str
    id: str | None = None  # committed events have one; message.delta and control frames do not
    data: Data | None = None


decode_event = msgspec.json.Decoder(Event).decode


class Stored(msgspec.Struct):
    """What the check reads of a stored envelope's tail (the outbox entry's `b`: no type, no id)."""

    data: Data | None = None


decode_stored = msgspec.json.Decoder(Stored).decode


class Created(msgspec.Struct):
    session_id: str


decode_created = msgspec.json.Decoder(Created).decode


@dataclass
class Stats:
    """What every client adds to, while a phase is measured (`measuring`)."""

    measuring: bool = False
    turns: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    examples: list[str] = field(default_factory=list)
    retried_503: int = 0

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.examples) < 10:
            self.examples.append(what)


class Client:
    """One session: the committed events it received, the messages it sent."""

    def __init__(self, name: str, port: int, stats: Stats) -> None:
        self.name, self.port, self.stats = name, port, stats
        self.sid = ""
        self.seen: list[str] = []  # committed event ids, as they arrived
        self.sent: list[str] = []  # message ids accepted (202, or sent on the socket)
        self.created = asyncio.Event()
        self.changed = asyncio.Event()
        self._waiting: dict[str, asyncio.Future[float]] = {}
        self._count = 0

    async def create(self, conn: Conn) -> None:
        status, body = await conn.request("POST", "/v1/sessions", b"{}")
        if status != 201:
            raise BenchError(f"POST /v1/sessions -> {status} {body[:200]!r}")
        self.sid = decode_created(body).session_id

    def received(self, raw: bytes | str) -> None:
        event = decode_event(raw)
        if event.id is None:
            if event.type == "error":
                self.stats.error(f"{self.name}: error frame {raw[:200]!r}")
            return
        self.seen.append(event.id)
        if event.type == SessionCreated.TYPE:
            self.created.set()
        elif event.type == TurnCompleted.TYPE and event.data is not None and event.data.message_id:
            waiter = self._waiting.pop(event.data.message_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(time.perf_counter())
        self.changed.set()

    async def follow(self) -> None:
        """Read the session's events, from its first, until cancelled."""
        raise NotImplementedError

    async def send(self, mid: str) -> bool:
        """Send the message; False if it was refused (counted as an error)."""
        raise NotImplementedError

    async def turns(self, more: Callable[[], bool]) -> None:
        """Turns one after the other while `more()` says so."""
        loop = asyncio.get_running_loop()
        while more():
            self._count += 1
            mid = f"{self.name}-{self._count}"
            done = self._waiting[mid] = loop.create_future()
            began = time.perf_counter()
            if not await self.send(mid):
                self._waiting.pop(mid, None)
                continue
            self.sent.append(mid)
            try:
                ended = await asyncio.wait_for(done, TURN_TIMEOUT_S)
            except TimeoutError:
                self.stats.error(f"{self.name}: the turn of {mid} did not complete in {TURN_TIMEOUT_S:.0f} s")
                return
            if self.stats.measuring:
                self.stats.turns += 1
                self.stats.latencies_ms.append((ended - began) * 1000.0)

    async def caught_up(self, last: str) -> bool:
        """Whether the outbox's last event arrives here within CAUGHT_UP_TIMEOUT_S."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CAUGHT_UP_TIMEOUT_S):
                while last not in self.seen:
                    self.changed.clear()
                    await self.changed.wait()
                return True
        return False


class HttpClient(Client):
    """POSTs on `port`, follows the SSE stream on `sse_port`."""

    def __init__(self, name: str, port: int, sse_port: int, ports: list[int], stats: Stats) -> None:
        super().__init__(name, port, stats)
        self.sse_port, self.ports = sse_port, ports
        self.conn: Conn | None = None

    async def open(self) -> None:
        self.conn = await Conn.open(self.port)

    async def send(self, mid: str) -> bool:
        body = b'{"text":"hello","message_id":"%s"}' % mid.encode()
        path = f"/v1/sessions/{self.sid}/messages"
        while True:
            assert self.conn is not None
            try:
                status, answer = await self.conn.request("POST", path, body)
            except (OSError, asyncio.IncompleteReadError) as exc:  # (the same message_id again would be safe)
                self.stats.error(f"{self.name}: POST {path} on {self.port}: {exc!r}")
                await self.conn.close()
                self.conn = await Conn.open(self.port)
                return False
            if status == 202:
                return True
            if status != 503:
                self.stats.error(f"{self.name}: POST {path} on {self.port} -> {status} {answer[:200]!r}")
                return False
            self.stats.retried_503 += 1  # (draining: the same message_id on another process is safe)
            await self.conn.close()
            await asyncio.sleep(1.0)
            self.port = self.ports[(self.ports.index(self.port) + 1) % len(self.ports)]
            self.conn = await Conn.open(self.port)

    async def follow(self) -> None:
        """The SSE stream, opened again after the last event id whenever it ends."""
        while True:
            reader, writer = await asyncio.open_connection(HOST, self.sse_port)
            try:
                after = f"Last-Event-ID: {self.seen[-1]}\r\n" if self.seen else ""
                head = f"GET /v1/sessions/{self.sid}/events HTTP/1.1\r\nHost: {HOST}:{self.sse_port}\r\n{after}\r\n"
                writer.write(head.encode())
                status = (await reader.readuntil(b"\r\n\r\n"))[9:12]
                if status != b"200":
                    self.stats.error(f"{self.name}: SSE on {self.sse_port} -> {status.decode()}")
                    await asyncio.sleep(1.0)
                    continue
                await self._events(reader)
                self.stats.error(f"{self.name}: the SSE stream on {self.sse_port} ended")
            except (OSError, asyncio.IncompleteReadError) as exc:
                self.stats.error(f"{self.name}: SSE on {self.sse_port}: {exc!r}")
                await asyncio.sleep(0.1)
            finally:
                writer.close()

    async def _events(self, reader: asyncio.StreamReader) -> None:
        """The chunked body's events until its last chunk; a `data:` line each (comments skipped)."""
        buf = b""
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            buf += (await reader.readexactly(size + 2))[:-2]
            while (end := buf.find(b"\n\n")) >= 0:
                block, buf = buf[:end], buf[end + 2 :]
                start = block.find(b"data: ")
                if start >= 0:
                    end = block.find(b"\n", start)
                    self.received(block[start + 6 : end if end >= 0 else None])
        await reader.readexactly(2)


class WsClient(Client):
    """Sends message frames on the socket it reads its events from."""

    def __init__(self, name: str, port: int, stats: Stats) -> None:
        super().__init__(name, port, stats)
        self.ws: ClientConnection | None = None
        self.opened = asyncio.Event()

    async def follow(self) -> None:
        url = f"ws://{HOST}:{self.port}/v1/sessions/{self.sid}/ws"
        try:
            async with connect(url, max_size=None, open_timeout=30, compression=None) as ws:
                self.ws = ws
                async for raw in ws:
                    self.received(raw)
            self.stats.error(f"{self.name}: the websocket on {self.port} closed")
        except (ConnectionClosed, InvalidHandshake, OSError, TimeoutError) as exc:
            self.stats.error(f"{self.name}: websocket on {self.port}: {exc!r}")

    async def send(self, mid: str) -> bool:
        if self.ws is None:
            self.stats.error(f"{self.name}: no websocket")
            return False
        try:
            await self.ws.send(f'{{"type":"message","text":"hello","message_id":"{mid}"}}')
        except ConnectionClosed as exc:
            self.stats.error(f"{self.name}: websocket send: {exc!r}")
            return False
        return True


@dataclass
class Checked:
    events: int = 0  # committed events the clients received
    lost: int = 0  # outbox events a client never received
    duplicated: int = 0  # events a client received more than once
    problems: list[str] = field(default_factory=list)  # out of order, not in the outbox, turns not once


async def check(clients: list[Client], redis: Any) -> Checked:
    """Each client's events against its session's outbox, once it has caught up with it."""
    out = Checked()
    for c in clients:
        raw: list[tuple[bytes, dict[bytes, bytes]]] = await redis.xrange(SessionKeys(c.sid).outbox)
        ids = [i.decode() for i, _ in raw]
        if not await c.caught_up(ids[-1]):
            out.problems.append(f"{c.name}: never received the outbox's last event {ids[-1]}")
        got, stored = c.seen, set(ids)
        out.events += len(got)
        out.duplicated += len(got) - len(set(got))
        out.lost += len(stored - set(got))
        if [i for i in dict.fromkeys(got) if i in stored] != [i for i in ids if i in set(got)]:
            out.problems.append(f"{c.name}: events out of order")
        if extra := set(got) - stored:
            out.problems.append(f"{c.name}: {len(extra)} events not in the outbox")
        completed: dict[str, int] = {}
        for _, fields in raw:
            if fields[b"t"] == TurnCompleted.TYPE.encode():
                data = decode_stored(b"{" + fields[b"b"]).data
                mid = data.message_id if data is not None else None
                completed[mid or ""] = completed.get(mid or "", 0) + 1
        if wrong := [m for m in c.sent if completed.get(m) != 1]:
            out.problems.append(f"{c.name}: {len(wrong)} messages without exactly one turn.completed, e.g. {wrong[0]}")
    return out

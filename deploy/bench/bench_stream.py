"""Streaming benchmark: keel's added latency from a model's text delta to an SSE and a websocket
client, beside the same stream proxied by a bare Starlette endpoint.

    python deploy/bench/bench_stream.py [--turns 20] [--warmup 2] [--deadline 600] [--pace-ms 0]

One run starts a private Valkey, a local Anthropic Messages API provider (this file,
--serve-provider), keel (`python -m app`, the demo agent on KEEL_MODEL=anthropic:bench with
ANTHROPIC_BASE_URL at the provider) and a bare baseline (this file, --serve-bare: a Starlette app
that opens the same provider stream with the official `anthropic` SDK per request and forwards
each text event as an SSE `data:` line on GET /stream, or as a text frame on the websocket /ws).

Every POST /v1/messages gets one text block of 100 `text_delta` events sent at full speed (no
pause), 40 characters each (~1,000 tokens in all). A delta's text begins with the provider's
send time, `time.time_ns()` as 19 digits, and its index (3 digits), so the client computes the
latency of each delta as its receive time minus that stamp (one machine, one CLOCK_REALTIME).
The provider sends the 100 deltas in a burst: the last ones also wait behind the earlier ones,
so p99 shows the server's throughput on a burst as much as its per-delta path. With --pace-ms
the provider waits that long before each delta after the first, as a model streams at its pace
(then each delta is a flush of its own, and what a delta costs alone shows).

The frontend protocols run the same turns: keel-aisdk POSTs the message to /v1/chat and reads
the AI SDK UI message stream it answers (to `[DONE]`), keel-agui POSTs a RunAgentInput to
/v1/agui and reads the AG-UI events (to RUN_FINISHED); their figures are shown beside keel's
own SSE (what each adapter adds) and the bare SSE.

For each of keel-SSE, keel-websocket, bare-SSE, bare-websocket, keel-aisdk and keel-agui, one client at a time runs
--warmup turns, then --turns timed turns, each on a connection of its own. A keel turn creates
a session, opens its event stream (SSE or websocket), waits for `session.created` (the reader
is in place), POSTs the message and reads until `turn.completed`. A bare turn opens GET /stream,
or the websocket and sends one frame, and reads until the `done` marker. Server CPU per delta is
the CPU seconds of the server process over the timed turns (everything a turn costs there: for
keel also the session, the POST and the committed events) divided by the deltas delivered; for
keel, Valkey's CPU too. Every delta is checked to arrive exactly once and in order (by its
index; for keel also contiguous offsets of one item and the joined text equal to the
`message.completed` text); lost, duplicated or reordered deltas are counted and reported.

It prints a table, the keel/bare ratios and one `RESULT {json}` line; the exit status is 1 when
any delta was lost, duplicated or out of order. Everything is bounded by --deadline seconds;
every process started here is stopped in a `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from support import (  # the sibling module: this file runs as a script
    HOST,
    BenchError,
    Conn,
    Deadline,
    Server,
    cpu_seconds,
    free_port,
    log_tail,
    new_loop,
    on_signal,
    percentile,
    positive,
    server_env,
    start_valkey,
    stop_process,
    wait_ready,
)
from websockets.asyncio.client import ClientConnection, connect

from harness.events import OUTCOMES, MessageCompleted, MessageDelta, SessionCreated, TurnCompleted

DELTAS = 100  # text_delta events per reply
DELTA_CHARS = 40  # characters per delta: 19-digit stamp, space, 3-digit index, space, padding
TOKENS = 1_000  # output tokens the provider reports
PAD = ("lorem ipsum dolor sit amet consectetur " * 2)[: DELTA_CHARS - 24]
TURN_TIMEOUT_S = 30.0
MODEL = "bench"
BODY = b'{"text":"hello"}'


# ---- the provider (runs in its own process: --serve-provider) ------------------------------


def _sse(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def provider_app(pace_s: float = 0.0) -> Starlette:
    """POST /v1/messages: Anthropic's Messages streaming protocol, one text block of DELTAS
    text_delta events at full speed (or `pace_s` apart), each stamped with its send time."""
    message: dict[str, Any] = {
        "id": "msg_bench",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": MODEL,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 20, "output_tokens": 1},
    }
    head = _sse("message_start", {"type": "message_start", "message": message}) + _sse("ping", {"type": "ping"})
    head += _sse(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    )
    before = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    before += b'"delta":{"type":"text_delta","text":"'
    after = f'{PAD}"}}}}\n\n'.encode()
    tail = _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    tail += _sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": TOKENS},
        },
    )
    tail += _sse("message_stop", {"type": "message_stop"})

    async def stream() -> AsyncIterator[bytes]:
        yield head
        for i in range(DELTAS):
            if pace_s and i:
                await asyncio.sleep(pace_s)  # (a model's pace)
            yield before + b"%019d %03d " % (time.time_ns(), i) + after
        yield tail

    async def messages(request: Request) -> Response:
        await request.body()
        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def readyz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    routes = [Route("/v1/messages", messages, methods=["POST"]), Route("/readyz", readyz, methods=["GET"])]
    return Starlette(routes=routes)


# ---- the bare baseline (runs in its own process: --serve-bare) -----------------------------


def bare_app(provider_port: int) -> Starlette:
    """GET /stream (SSE) and the websocket /ws (a stream per client frame): the provider's text
    events forwarded as {"delta": text}, then a `done` marker."""
    import anthropic

    client = anthropic.AsyncAnthropic(api_key="x", base_url=f"http://{HOST}:{provider_port}", max_retries=0)
    enc = msgspec.json.Encoder()

    async def deltas() -> AsyncIterator[bytes]:
        messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hello"}]
        async with client.messages.stream(model=MODEL, max_tokens=4096, messages=messages) as stream:
            async for event in stream:
                if event.type == "text" and event.text:
                    yield enc.encode({"delta": event.text})
            await stream.get_final_message()

    async def sse(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            async for d in deltas():
                yield b"data: " + d + b"\n\n"
            yield b"event: done\ndata: {}\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        with suppress(WebSocketDisconnect):
            while True:
                await websocket.receive_text()
                async for d in deltas():
                    await websocket.send_text(d.decode())
                await websocket.send_text('{"done":true}')

    async def readyz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await client.close()

    routes: list[BaseRoute] = [
        Route("/stream", sse, methods=["GET"]),
        WebSocketRoute("/ws", ws),
        Route("/readyz", readyz, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def serve(app: Starlette, port: int) -> None:
    # as keel serves (app/__main__.py: uvicorn_options): the sans-I/O websockets, no deflate
    uvicorn.run(app, host=HOST, port=port, log_level="warning", ws="websockets-sansio", ws_per_message_deflate=False)


# ---- the client --------------------------------------------------------------------------


class Head(msgspec.Struct):
    type: str


class KeelDeltaData(msgspec.Struct):
    item_id: str
    delta: str
    offset: int


class KeelDelta(msgspec.Struct):
    data: KeelDeltaData


class CompletedData(msgspec.Struct):
    item_id: str = ""
    text: str = ""


class Completed(msgspec.Struct):
    data: CompletedData


class BareDelta(msgspec.Struct):
    delta: str


class Created(msgspec.Struct):
    session_id: str


head_dec = msgspec.json.Decoder(Head)
keel_delta_dec = msgspec.json.Decoder(KeelDelta)
completed_dec = msgspec.json.Decoder(Completed)
bare_delta_dec = msgspec.json.Decoder(BareDelta)
created_dec = msgspec.json.Decoder(Created)
KEEL_END = set(OUTCOMES)  # a turn's last event


@dataclass
class Frames:
    """What a client got in one turn: (receive time_ns, event type, JSON) in order."""

    got: list[tuple[int, str, bytes]] = field(default_factory=list)


class SseReader:
    """Server-sent events off an HTTP/1.1 response (chunked or not) on asyncio streams; an
    event's receive time is when the read that completed it returned."""

    def __init__(self, reader: asyncio.StreamReader, chunked: bool) -> None:
        self._r = reader
        self._chunked = chunked
        self._buf = b""
        self._ready: deque[tuple[int, str, bytes]] = deque()

    @classmethod
    async def open(cls, port: int, path: str, body: bytes | None = None) -> tuple[SseReader, asyncio.StreamWriter]:
        """GET `path`, or POST `body` (JSON) to it, and read the event stream it answers."""
        reader, writer = await asyncio.open_connection(HOST, port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        method = "GET" if body is None else "POST"
        head = f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAccept: text/event-stream\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode() + b"\r\n" + (body or b""))
        await writer.drain()
        raw = await reader.readuntil(b"\r\n\r\n")
        if raw[9:12] != b"200":
            writer.close()
            raise BenchError(f"{path} -> {raw[:200]!r}")
        chunked = b"transfer-encoding: chunked" in raw.lower()
        return cls(reader, chunked), writer

    async def _fill(self) -> None:
        if self._chunked:
            size = int((await self._r.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await self._r.readexactly(size + 2)
            if size == 0:
                raise BenchError("the event stream ended")
            data = data[:-2]
        else:
            data = await self._r.read(65536)
            if not data:
                raise BenchError("the event stream ended")
        now = time.time_ns()
        self._buf += data
        while (end := self._buf.find(b"\n\n")) >= 0:
            block, self._buf = self._buf[:end], self._buf[end + 2 :]
            name, payload = "message", b""
            for line in block.split(b"\n"):
                if line.startswith(b"event: "):
                    name = line[7:].decode()
                elif line.startswith(b"data: "):
                    payload = line[6:]
            if payload:
                self._ready.append((now, name, payload))

    async def next(self) -> tuple[int, str, bytes]:
        while not self._ready:
            await self._fill()
        return self._ready.popleft()


async def close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with suppress(OSError):
        await asyncio.wait_for(writer.wait_closed(), 2.0)


async def ws_connect(port: int, path: str) -> ClientConnection:
    return await connect(f"ws://{HOST}:{port}{path}", compression=None, max_size=None, open_timeout=10.0)


def ws_text(frame: str | bytes) -> bytes:
    return frame.encode() if isinstance(frame, str) else frame


async def keel_session(api: Conn) -> str:
    status, body = await api.request("POST", "/v1/sessions", b"{}")
    if status != 201:
        raise BenchError(f"keel POST /v1/sessions -> {status} {body[:300]!r}")
    return created_dec.decode(body).session_id


async def keel_post(api: Conn, sid: str) -> None:
    status, body = await api.request("POST", f"/v1/sessions/{sid}/messages", BODY)
    if status != 202:
        raise BenchError(f"keel POST /v1/sessions/{sid}/messages -> {status} {body[:300]!r}")


async def keel_sse_turn(port: int, api: Conn) -> Frames:
    sid = await keel_session(api)
    sse, writer = await SseReader.open(port, f"/v1/sessions/{sid}/events")
    out = Frames()
    try:
        while (await sse.next())[1] != SessionCreated.TYPE:  # the reader is in place
            pass
        await keel_post(api, sid)
        while True:
            got = await sse.next()
            out.got.append(got)
            if got[1] in KEEL_END:
                return out
    finally:
        await close_writer(writer)


async def keel_ws_turn(port: int, api: Conn) -> Frames:
    sid = await keel_session(api)
    ws = await ws_connect(port, f"/v1/sessions/{sid}/ws")
    out = Frames()
    try:
        while head_dec.decode(ws_text(await ws.recv(decode=False))).type != SessionCreated.TYPE:
            pass
        await keel_post(api, sid)
        while True:
            raw = ws_text(await ws.recv(decode=False))
            now = time.time_ns()
            kind = head_dec.decode(raw).type
            out.got.append((now, kind, raw))
            if kind in KEEL_END:
                return out
    finally:
        await ws.close()


async def adapter_turn(
    port: int, api: Conn, path: str, body: Callable[[str], bytes], last: Callable[[bytes], bool]
) -> Frames:
    """A turn through a frontend protocol: its POST is the message and answers the stream."""
    sid = await keel_session(api)
    sse, writer = await SseReader.open(port, path, body(sid))
    out = Frames()
    try:
        while True:
            got = await sse.next()
            out.got.append(got)
            if last(got[2]):
                return out
    finally:
        await close_writer(writer)


def _chat_body(sid: str) -> bytes:
    user = {"id": "m1", "role": "user", "parts": [{"type": "text", "text": "hello"}]}
    return msgspec.json.encode({"id": sid, "messages": [user], "trigger": "submit-message"})


def _agui_body(sid: str) -> bytes:
    user = {"id": "m1", "role": "user", "content": "hello"}
    return msgspec.json.encode({"threadId": sid, "runId": "r1", "messages": [user], "state": {}, "tools": []})


async def aisdk_turn(port: int, api: Conn) -> Frames:
    return await adapter_turn(port, api, "/v1/chat", _chat_body, lambda raw: raw == b"[DONE]")


async def agui_turn(port: int, api: Conn) -> Frames:
    ends = (b'{"type":"RUN_FINISHED"', b'{"type":"RUN_ERROR"')
    return await adapter_turn(port, api, "/v1/agui", _agui_body, lambda raw: raw.startswith(ends))


async def bare_sse_turn(port: int, api: Conn) -> Frames:
    sse, writer = await SseReader.open(port, "/stream")
    out = Frames()
    try:
        while True:
            got = await sse.next()
            if got[1] == "done":
                return out
            out.got.append(got)
    finally:
        await close_writer(writer)


async def bare_ws_turn(port: int, api: Conn) -> Frames:
    ws = await ws_connect(port, "/ws")
    out = Frames()
    try:
        await ws.send("go")
        while True:
            raw = ws_text(await ws.recv(decode=False))
            now = time.time_ns()
            if raw == b'{"done":true}':
                return out
            out.got.append((now, "message", raw))
    finally:
        await ws.close()


# ---- checks and figures ------------------------------------------------------------------


@dataclass
class Tally:
    """One variant's deltas over its timed turns."""

    latencies_ms: list[float] = field(default_factory=list)
    firsts_ms: list[float] = field(default_factory=list)  # the latency of each turn's first delta
    spans_ms: list[float] = field(default_factory=list)  # provider: first to last delta sent, per turn
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    out_of_order: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, what: str) -> None:
        if len(self.problems) < 5:
            self.problems.append(what)


def keel_deltas(frames: Frames, tally: Tally) -> list[tuple[int, str]]:
    """The deltas of a keel turn, checked: one item, contiguous offsets, the completed text."""
    deltas = [(t, keel_delta_dec.decode(raw).data) for t, kind, raw in frames.got if kind == MessageDelta.TYPE]
    if frames.got and frames.got[-1][1] != TurnCompleted.TYPE:
        tally.problem(f"the turn ended with {frames.got[-1][1]}: {frames.got[-1][2][:300]!r}")
    items = {d.item_id for _, d in deltas}
    completed = [completed_dec.decode(raw).data for _, kind, raw in frames.got if kind == MessageCompleted.TYPE]
    text = {c.item_id: c.text for c in completed}
    if len(items) != 1:
        tally.problem(f"deltas of {len(items)} items in one turn")
    offset = 0
    for _, d in deltas:
        if d.offset != offset:
            tally.problem(f"offset {d.offset}, expected {offset}")
        offset = d.offset + len(d.delta)
    joined = "".join(d.delta for _, d in deltas)
    for item in items:
        if text.get(item) != joined:
            tally.problem(f"item {item}: the deltas joined ({len(joined)} chars) are not its message.completed text")
    return [(t, d.delta) for t, d in deltas]


class Chunk(msgspec.Struct):
    type: str
    delta: str = ""
    finishReason: str = ""  # (the protocol's name)


chunk_dec = msgspec.json.Decoder(Chunk)


def _joined(deltas: list[tuple[int, str]], tally: Tally) -> None:
    if sum(len(d) for _, d in deltas) != DELTAS * DELTA_CHARS:
        tally.problem(f"the deltas make {sum(len(d) for _, d in deltas)} characters, not {DELTAS * DELTA_CHARS}")


def aisdk_deltas(frames: Frames, tally: Tally) -> list[tuple[int, str]]:
    """A UI message stream's text deltas, checked: it finished with `stop`, then [DONE]."""
    chunks = [(t, chunk_dec.decode(raw)) for t, _, raw in frames.got if raw != b"[DONE]"]
    if not chunks or chunks[-1][1].type != "finish" or chunks[-1][1].finishReason != "stop":
        tally.problem(f"the stream did not finish with stop: {frames.got[-2:]!r}")
    deltas = [(t, c.delta) for t, c in chunks if c.type == "text-delta"]
    _joined(deltas, tally)
    return deltas


def agui_deltas(frames: Frames, tally: Tally) -> list[tuple[int, str]]:
    """An AG-UI run's TEXT_MESSAGE_CONTENT deltas, checked: it ended with RUN_FINISHED."""
    events = [(t, chunk_dec.decode(raw)) for t, _, raw in frames.got]
    if not events or events[-1][1].type != "RUN_FINISHED":
        tally.problem(f"the run did not finish: {frames.got[-1:]!r}")
    deltas = [(t, e.delta) for t, e in events if e.type == "TEXT_MESSAGE_CONTENT"]
    _joined(deltas, tally)
    return deltas


def bare_deltas(frames: Frames, tally: Tally) -> list[tuple[int, str]]:
    return [(t, bare_delta_dec.decode(raw).delta) for t, _, raw in frames.got]


def account(deltas: list[tuple[int, str]], tally: Tally) -> None:
    """Latency per delta from its stamp; each index exactly once, in order."""
    seen: set[int] = set()
    last = -1
    stamps: list[int] = []
    for received, text in deltas:
        if len(text) % DELTA_CHARS:
            tally.problem(f"a delta of {len(text)} characters: {text[:80]!r}")
        for at in range(0, len(text) - DELTA_CHARS + 1, DELTA_CHARS):  # (a merged delta counts each part)
            try:
                stamp, index = int(text[at : at + 19]), int(text[at + 20 : at + 23])
            except ValueError:
                tally.problem(f"an unstamped delta: {text[at : at + 80]!r}")
                continue
            if index in seen:
                tally.duplicated += 1
                continue
            if index < last:
                tally.out_of_order += 1
            seen.add(index)
            last = max(last, index)
            stamps.append(stamp)
            tally.latencies_ms.append((received - stamp) / 1e6)
            if index == 0:
                tally.firsts_ms.append(tally.latencies_ms[-1])
    tally.delivered += len(seen)
    tally.lost += DELTAS - len(seen & set(range(DELTAS)))
    if stamps:
        tally.spans_ms.append((max(stamps) - min(stamps)) / 1e6)


@dataclass
class Variant:
    system: str
    channel: str
    server: Server
    turn: Callable[[int, Conn], Awaitable[Frames]]
    parse: Callable[[Frames, Tally], list[tuple[int, str]]]

    @property
    def name(self) -> str:
        return f"{self.system}-{self.channel}"


@asynccontextmanager
async def bounded(variant: Variant, deadline: Deadline, cap: float) -> AsyncIterator[None]:
    """Bound a step in time; on a timeout or a broken connection, say which variant and show its log."""
    try:
        async with asyncio.timeout(deadline.left(cap)):
            yield
    except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        alive = variant.server.proc is not None and variant.server.proc.poll() is None
        raise BenchError(
            f"{variant.name}: {type(exc).__name__}: {exc} (server {'running' if alive else 'exited'}):\n"
            f"{log_tail(variant.server.log)}"
        ) from exc
    except Exception as exc:
        if type(exc).__module__.startswith("websockets"):
            raise BenchError(f"{variant.name}: {type(exc).__name__}: {exc}:\n{log_tail(variant.server.log)}") from exc
        raise


async def run_variant(variant: Variant, valkey_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    deadline: Deadline = args.deadline_obj
    port = variant.server.port
    async with bounded(variant, deadline, TURN_TIMEOUT_S):
        api = await Conn.open(port)
    try:
        scratch = Tally()
        for _ in range(args.warmup):
            async with bounded(variant, deadline, TURN_TIMEOUT_S):
                frames = await variant.turn(port, api)
            account(variant.parse(frames, scratch), scratch)
        tally = Tally()
        timed: list[Frames] = []
        cpu0, vk0, me0 = cpu_seconds(variant.server.pid), cpu_seconds(valkey_pid), time.process_time()
        t0 = time.perf_counter()
        for _ in range(args.turns):
            async with bounded(variant, deadline, TURN_TIMEOUT_S):
                timed.append(await variant.turn(port, api))
        wall = time.perf_counter() - t0
        cpu1, vk1, me1 = cpu_seconds(variant.server.pid), cpu_seconds(valkey_pid), time.process_time()
    finally:
        await api.close()
    for frames in timed:  # decoded and checked after the timed turns: the client's CPU stays low meanwhile
        account(variant.parse(frames, tally), tally)
    variant.server.check_alive()
    n = max(tally.delivered, 1)
    lat = tally.latencies_ms or [float("nan")]
    return {
        "turns": args.turns,
        "deltas_delivered": tally.delivered,
        "deltas_lost": tally.lost,
        "deltas_duplicated": tally.duplicated,
        "deltas_out_of_order": tally.out_of_order,
        "problems": tally.problems,
        "p50_ms": statistics.median(lat),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat),
        "first_ms": statistics.median(tally.firsts_ms) if tally.firsts_ms else float("nan"),
        "mean_ms": statistics.fmean(lat),
        "provider_burst_ms": statistics.median(tally.spans_ms) if tally.spans_ms else float("nan"),
        "turn_ms": wall * 1000.0 / args.turns,
        "server_cpu_us_per_delta": (cpu1 - cpu0) * 1e6 / n,
        "valkey_cpu_us_per_delta": (vk1 - vk0) * 1e6 / n,
        "client_cpu_us_per_delta": (me1 - me0) * 1e6 / n,
        "server_cpu_s": cpu1 - cpu0,
    }


async def measure(
    servers: list[Server], variants: list[Variant], valkey_pid: int, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    for server in servers:
        await wait_ready(server, args.deadline_obj)
    return {v.name: await run_variant(v, valkey_pid, args) for v in variants}


# ---- report ------------------------------------------------------------------------------


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    print(
        f"\n{args.warmup} warm-up + {args.turns} timed turns per variant, one client at a time, a connection per turn"
    )
    pace = f"{args.pace_ms:g} ms apart" if args.pace_ms else "at full speed"
    print(f"provider: {DELTAS} text deltas of {DELTA_CHARS} chars (~{TOKENS:,} tokens) per turn, {pace}")
    print("latency: provider send stamp -> client receipt, per delta; CPU: per delta delivered, timed turns\n")
    cols = (
        "variant",
        "p50 ms",
        "p99 ms",
        "max ms",
        "first ms",
        "burst ms",
        "turn ms",
        "CPU us/delta",
        "Valkey us",
        "deltas",
        "lost",
    )
    print("{:<10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>12} {:>9} {:>7} {:>5}".format(*cols))
    for name, r in results.items():
        print(
            f"{name:<10} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['max_ms']:>8.3f} {r['first_ms']:>8.3f}"
            f" {r['provider_burst_ms']:>8.3f}"
            f" {r['turn_ms']:>8.1f} {r['server_cpu_us_per_delta']:>12.1f} {r['valkey_cpu_us_per_delta']:>9.1f}"
            f" {r['deltas_delivered']:>7} {r['deltas_lost']:>5}"
        )
    print(
        "(first ms: a turn's first delta, median turn; burst ms: the provider's first to last delta sent,"
        " median turn;\n turn ms: a whole timed turn, client side; Valkey us: Valkey's CPU per delta)"
    )
    ratios: dict[str, float] = {}
    added: dict[str, float] = {}
    for channel in ("sse", "ws"):
        k, b = results[f"keel-{channel}"], results[f"bare-{channel}"]
        for key in ("p50_ms", "p99_ms", "server_cpu_us_per_delta"):
            ratios[f"{channel}_{key}"] = k[key] / b[key] if b[key] else float("nan")
        added[f"{channel}_p50_ms"] = k["p50_ms"] - b["p50_ms"]
        added[f"{channel}_p99_ms"] = k["p99_ms"] - b["p99_ms"]
    for channel, label in (("sse", "SSE"), ("ws", "websocket")):
        print(
            f"keel/bare {label}: p50 x{ratios[f'{channel}_p50_ms']:.2f} ({added[f'{channel}_p50_ms']:+.3f} ms),"
            f" p99 x{ratios[f'{channel}_p99_ms']:.2f} ({added[f'{channel}_p99_ms']:+.3f} ms),"
            f" CPU/delta x{ratios[f'{channel}_server_cpu_us_per_delta']:.2f}"
        )
    beside_keel: dict[str, float] = {}
    ks, bs = results["keel-sse"], results["bare-sse"]
    for adapter, label in (("aisdk", "AI SDK UI stream"), ("agui", "AG-UI")):
        a = results[f"keel-{adapter}"]
        for key in ("p50_ms", "p99_ms", "server_cpu_us_per_delta"):
            beside_keel[f"{adapter}_{key}"] = a[key] - ks[key]
            ratios[f"{adapter}_{key}"] = a[key] / bs[key] if bs[key] else float("nan")
        print(
            f"{label} beside keel's SSE: p50 {beside_keel[f'{adapter}_p50_ms']:+.3f} ms,"
            f" p99 {beside_keel[f'{adapter}_p99_ms']:+.3f} ms,"
            f" CPU/delta {beside_keel[f'{adapter}_server_cpu_us_per_delta']:+.1f} us"
            f" (x{a['server_cpu_us_per_delta'] / ks['server_cpu_us_per_delta']:.2f});"
            f" over bare SSE: p50 x{ratios[f'{adapter}_p50_ms']:.2f}"
        )
    for name, r in results.items():
        bad = r["deltas_lost"] + r["deltas_duplicated"] + r["deltas_out_of_order"]
        if bad or r["problems"]:
            print(
                f"NOTE: {name}: {r['deltas_lost']} lost, {r['deltas_duplicated']} duplicated,"
                f" {r['deltas_out_of_order']} out of order; {'; '.join(r['problems'])}"
            )
    out = {
        "config": {
            "turns": args.turns,
            "warmup": args.warmup,
            "deltas_per_turn": DELTAS,
            "delta_chars": DELTA_CHARS,
            "pace_ms": args.pace_ms,
        },
        "results": results,
        "ratio_keel_over_bare": ratios,
        "added_ms_keel_minus_bare": added,
        "adapter_minus_keel_sse": beside_keel,
    }
    print("RESULT " + json.dumps(out, default=float), flush=True)
    return out


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--turns", type=positive, default=20, help="timed turns per variant (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up turns per variant, not counted (default 2)")
    ap.add_argument("--deadline", type=float, default=600.0, help="global time budget in seconds (default 600)")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="the provider's pause before each delta (default 0)")
    ap.add_argument("--serve-provider", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--provider-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.turns > 10_000 or not 0 <= args.warmup <= 1_000:
        ap.error("keep --turns <= 10000 and 0 <= --warmup <= 1000")
    if not 0 <= args.pace_ms <= 1_000:
        ap.error("keep 0 <= --pace-ms <= 1000")
    return args


def run(args: argparse.Namespace) -> int:
    args.deadline_obj = deadline = Deadline(args.deadline)
    tmp = Path(tempfile.mkdtemp(prefix="keel-bench-stream-"))
    valkey: subprocess.Popen[bytes] | None = None
    servers: list[Server] = []
    me = [sys.executable, str(Path(__file__).resolve())]
    try:
        (tmp / "valkey").mkdir()
        valkey, valkey_port = start_valkey(tmp / "valkey", deadline)
        provider = Server("provider", free_port(), tmp / "provider.log")
        keel = Server("keel", free_port(), tmp / "keel.log")
        bare = Server("bare", free_port(), tmp / "bare.log")
        servers = [provider, keel, bare]
        provider.start(
            [*me, "--serve-provider", "--port", str(provider.port), "--pace-ms", str(args.pace_ms)], server_env({})
        )
        keel_env = {"REDIS_URL": f"redis://{HOST}:{valkey_port}", "KEEL_HOST": HOST, "KEEL_PORT": str(keel.port)}
        keel_env |= {
            "KEEL_DATA_DIR": str(tmp / "keel"),
            "KEEL_LOG_LEVEL": "warning",
            "KEEL_MODEL": f"anthropic:{MODEL}",
        }
        keel_env |= {"ANTHROPIC_API_KEY": "x", "ANTHROPIC_BASE_URL": f"http://{HOST}:{provider.port}"}
        keel.start([sys.executable, "-m", "app"], server_env(keel_env))
        bare_argv = [*me, "--serve-bare", "--port", str(bare.port), "--provider-port", str(provider.port)]
        bare.start(bare_argv, server_env({}))
        variants = [
            Variant("keel", "sse", keel, keel_sse_turn, keel_deltas),
            Variant("keel", "ws", keel, keel_ws_turn, keel_deltas),
            Variant("bare", "sse", bare, bare_sse_turn, bare_deltas),
            Variant("bare", "ws", bare, bare_ws_turn, bare_deltas),
            Variant("keel", "aisdk", keel, aisdk_turn, aisdk_deltas),
            Variant("keel", "agui", keel, agui_turn, agui_deltas),
        ]
        with asyncio.Runner(loop_factory=new_loop) as runner:
            results = runner.run(measure(servers, variants, valkey.pid, args))
        for s in servers:
            s.check_alive()
        out = report(results, args)
        bad = sum(r["deltas_lost"] + r["deltas_duplicated"] + r["deltas_out_of_order"] for r in results.values())
        return 1 if bad or any(r["problems"] for r in out["results"].values()) else 0
    except BenchError as exc:
        print(f"bench_stream: {exc}", file=sys.stderr)
        return 1
    finally:
        for s in servers:
            stop_process(s.proc)
        stop_process(valkey)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    args = parse_args()
    if args.serve_provider or args.serve_bare:
        if args.port is None or (args.serve_bare and args.provider_port is None):
            print("--serve-provider needs --port; --serve-bare needs --port and --provider-port", file=sys.stderr)
            return 2
        serve(provider_app(args.pace_ms / 1000) if args.serve_provider else bare_app(args.provider_port), args.port)
        return 0
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

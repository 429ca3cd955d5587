"""A local server that speaks Anthropic's Messages API streaming protocol (SSE, event by event as
the API documents it: message_start, content_block_start/delta/stop, ping, message_delta with
cumulative usage, message_stop, and `error` events), for the real SDK client to talk to.

Each POST /v1/messages takes the next scripted `Reply` (or a function of the request body that
makes one) and records the request body. A Reply is
a stream of content blocks, or an HTTP error, and can cut the stream, go idle, or wait on an
event so a test can act mid-stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.conftest import LiveServer, free_port


@dataclass
class Reply:
    blocks: list[dict[str, Any]] = field(default_factory=list)  # text / tool_use / thinking, as final blocks
    chunks: int = 3  # deltas per text block
    usage: dict[str, int] = field(default_factory=lambda: {"input_tokens": 20, "output_tokens": 7})
    stop_reason: str = "end_turn"
    status: int = 200  # not 200: an error answer with `error` and `headers`
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    cut_after: int | None = None  # close the connection after this many events
    idle_after: int | None = None  # send nothing more after this many events (connection kept open)
    error_event_after: int | None = None  # an `error` event (overloaded) after this many events
    end_after: int | None = None  # end the response cleanly after this many events (no message_stop)
    hold: asyncio.Event | None = None  # wait for this before the first delta
    pace: float = 0.0  # seconds between events (a model that types slowly)


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def tool_use(tid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": tid, "name": name, "input": args}


def thinking(t: str, signature: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": t, "signature": signature}


def events(reply: Reply) -> list[tuple[str, dict[str, Any]]]:
    start_usage = {
        "input_tokens": reply.usage.get("input_tokens", 0),
        "output_tokens": 1,
        "cache_creation_input_tokens": reply.usage.get("cache_creation_input_tokens", 0),
        "cache_read_input_tokens": reply.usage.get("cache_read_input_tokens", 0),
    }
    message = {
        "id": "msg_test",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "claude-test",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": start_usage,
    }
    out: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": message})]
    out.append(("ping", {"type": "ping"}))
    for index, block in enumerate(reply.blocks):
        kind = block["type"]
        if kind == "text":
            start: dict[str, Any] = {"type": "text", "text": ""}
            t = block["text"]
            step = max(1, -(-len(t) // reply.chunks))
            deltas = [{"type": "text_delta", "text": t[i : i + step]} for i in range(0, len(t), step)]
        elif kind == "tool_use":
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            raw = json.dumps(block["input"])
            half = len(raw) // 2
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in (raw[:half], raw[half:])]
        else:
            start = {"type": "thinking", "thinking": ""}
            deltas = [{"type": "thinking_delta", "thinking": block["thinking"]}]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        out.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}))
        for d in deltas:
            out.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    out.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reply.stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": reply.usage.get("output_tokens", 0)},
            },
        )
    )
    out.append(("message_stop", {"type": "message_stop"}))
    return out


class AnthropicServer:
    def __init__(self) -> None:
        self.replies: list[Reply | Callable[[dict[str, Any]], Reply]] = []  # a function: of the request
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.clients: list[Any] = []  # SDK clients made for this server, closed with it
        self.streaming = asyncio.Event()  # a text delta went out
        self.requested = asyncio.Event()  # a request came in
        self.dropped = asyncio.Event()  # a stream ended before its end: the client closed it
        self.dropped_at = 0.0
        app = Starlette(routes=[Route("/v1/messages", self.messages, methods=["POST"])])
        self.live = LiveServer(app, free_port())
        self.url = self.live.base

    async def __aenter__(self) -> AnthropicServer:
        await self.live.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.live.stop()

    async def messages(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.requests.append(body)
        self.requested.set()
        self.headers.append(dict(request.headers))
        if not self.replies:
            return JSONResponse({"type": "error", "error": {"type": "api_error", "message": "no reply scripted"}}, 500)
        scripted = self.replies.pop(0)
        reply = scripted if isinstance(scripted, Reply) else scripted(body)
        if reply.status != 200:
            failure = {"type": "error", "error": reply.error or {"type": "api_error", "message": "failed"}}
            return JSONResponse(failure, reply.status, headers=reply.headers)
        return StreamingResponse(self._stream(reply), media_type="text/event-stream")

    async def _stream(self, reply: Reply) -> AsyncIterator[bytes]:
        finished = False
        try:
            for n, (name, data) in enumerate(events(reply)):
                if n == reply.end_after:
                    finished = True
                    return
                if n == reply.cut_after:
                    raise ConnectionResetError("cut by the test server")  # uvicorn drops the connection
                if n == reply.idle_after:
                    await asyncio.sleep(3600)
                if n == reply.error_event_after:
                    err = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
                    yield b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n"
                    return
                if name == "content_block_delta" and reply.hold is not None:
                    await reply.hold.wait()
                yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                if name == "content_block_delta":
                    self.streaming.set()
                await asyncio.sleep(reply.pace)
            finished = True
        finally:
            if not finished and not self.dropped.is_set():
                self.dropped_at = time.monotonic()
                self.dropped.set()

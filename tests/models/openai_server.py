"""A local server that speaks OpenAI's streaming protocols for the real SDK: the Responses API
(`POST /v1/responses`: response.created, response.output_text.delta..., response.completed
with the whole response) and Chat Completions (`POST /v1/chat/completions`: chunks with
content and tool-call deltas, a usage chunk, then `[DONE]`). Each request takes the next
scripted `Turn` and is recorded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.conftest import LiveServer, free_port


@dataclass
class Turn:
    text: str = ""
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (provider call id, name, args)
    reasoning: list[dict[str, Any]] = field(default_factory=list)  # reasoning output items, as the API gives them
    usage: dict[str, int] = field(default_factory=lambda: {"input": 30, "output": 6, "cached": 0, "written": 0})
    status: int = 200
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    hold: asyncio.Event | None = None  # wait for this before the first delta
    cut_after: int | None = None  # close the connection after this many deltas
    idle_after: int | None = None  # send nothing more after this many deltas (connection kept open)
    finish: bool = True  # chat: end with a finish_reason, usage and [DONE] (else just stop)


def sse(data: dict[str, Any] | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


class OpenAIServer:
    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.requests: list[dict[str, Any]] = []
        self.clients: list[Any] = []
        app = Starlette(
            routes=[
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )
        self.live = LiveServer(app, free_port())
        self.url = self.live.base + "/v1"

    async def __aenter__(self) -> OpenAIServer:
        await self.live.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self.clients:
            await client.close()
        await self.live.stop()

    async def _next(self, request: Request) -> Turn | Response:
        self.requests.append(json.loads(await request.body()))
        turn = self.turns.pop(0) if self.turns else Turn(status=500, error={"message": "no turn scripted"})
        if turn.status != 200:
            body = {"error": {"type": "error", "code": None, "param": None, **(turn.error or {"message": "failed"})}}
            return JSONResponse(body, turn.status, headers=turn.headers)
        return turn

    async def responses(self, request: Request) -> Response:
        turn = await self._next(request)
        if isinstance(turn, Response):
            return turn
        return StreamingResponse(self._responses(turn), media_type="text/event-stream")

    async def chat(self, request: Request) -> Response:
        turn = await self._next(request)
        if isinstance(turn, Response):
            return turn
        return StreamingResponse(self._chat(turn), media_type="text/event-stream")

    async def _responses(self, turn: Turn) -> AsyncIterator[bytes]:
        base = {"id": "resp_1", "object": "response", "created_at": 1, "model": "gpt-test", "status": "in_progress"}
        yield sse({"type": "response.created", "sequence_number": 0, "response": {**base, "output": []}})
        seq = 1
        if turn.hold is not None:
            await turn.hold.wait()
        for n, piece in enumerate(_pieces(turn.text)):
            await _misbehave(turn, n)
            delta = {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0}
            yield sse({**delta, "content_index": 0, "delta": piece, "logprobs": [], "sequence_number": seq})
            seq += 1
            await asyncio.sleep(0)
        output: list[dict[str, Any]] = list(turn.reasoning)
        if turn.text:
            content = [{"type": "output_text", "text": turn.text, "annotations": []}]
            output.append(
                {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": content}
            )
        for n, (cid, name, args) in enumerate(turn.calls):
            call = {"type": "function_call", "id": f"fc_{n}", "call_id": cid, "name": name, "status": "completed"}
            output.append({**call, "arguments": json.dumps(args)})
        u = turn.usage
        usage = {
            "input_tokens": u["input"],
            "input_tokens_details": {"cached_tokens": u["cached"], "cache_write_tokens": u["written"]},
            "output_tokens": u["output"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["input"] + u["output"],
        }
        done = {**base, "status": "completed", "output": output, "usage": usage}
        yield sse({"type": "response.completed", "sequence_number": seq, "response": done})

    async def _chat(self, turn: Turn) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}

        yield sse(chunk({"role": "assistant", "content": ""}))
        if turn.hold is not None:
            await turn.hold.wait()
        for n, piece in enumerate(_pieces(turn.text)):
            await _misbehave(turn, n)
            yield sse(chunk({"content": piece}))
            await asyncio.sleep(0)
        for n, (cid, name, args) in enumerate(turn.calls):
            raw = json.dumps(args)
            first = {"index": n, "id": cid, "type": "function", "function": {"name": name, "arguments": raw[:3]}}
            yield sse(chunk({"tool_calls": [first]}))
            yield sse(chunk({"tool_calls": [{"index": n, "function": {"arguments": raw[3:]}}]}))
        if not turn.finish:
            return
        yield sse(chunk({}, "tool_calls" if turn.calls else "stop"))
        u = turn.usage
        usage = {
            "prompt_tokens": u["input"],
            "completion_tokens": u["output"],
            "total_tokens": u["input"] + u["output"],
            "prompt_tokens_details": {"cached_tokens": u["cached"]},
        }
        yield sse(
            {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [], "usage": usage}
        )
        yield sse("[DONE]")


async def _misbehave(turn: Turn, n: int) -> None:
    if n == turn.cut_after:
        raise ConnectionResetError("cut by the test server")  # uvicorn drops the connection
    if n == turn.idle_after:
        await asyncio.sleep(3600)


def _pieces(text: str, n: int = 3) -> list[str]:
    if not text:
        return []
    step = max(1, -(-len(text) // n))
    return [text[i : i + step] for i in range(0, len(text), step)]

"""What a client sees of a draining process (channels/drain.py), in process: open SSE streams end
cleanly and websockets close with 1012 at once, new requests answer 503 `draining` with
Retry-After (and change nothing), new websockets are closed with 1012, /healthz still answers,
and the drain settles once nothing is open. tests/app/test_lifecycle.py does it with SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from redis.asyncio import Redis
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from channels.drain import Drain
from harness import Agent
from harness.models import ModelReply, ScriptedModel


async def test_a_drain_ends_streams_and_refuses_what_comes_after(serve: Any, redis: Redis) -> None:
    live = await serve(Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="x"))))
    drain: Drain = live.app.state.drain
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        async with (
            c.stream("GET", f"/v1/sessions/{sid}/events") as sse,
            connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws,
        ):
            lines = sse.aiter_lines()
            async with asyncio.timeout(5):
                while not (await anext(lines)).startswith("event: session.created"):
                    pass
                assert json.loads(await ws.recv())["type"] == "session.created"
            assert drain.open == 2
            drain.begin()
            async with asyncio.timeout(5):
                rest = [line async for line in lines]  # ends: the last chunk came (no error)
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        await ws.recv()
            assert ws.close_code == 1012
        assert not [line for line in rest if line.startswith("id: ")]

        keys_before = sorted(await redis.keys("*"))
        r = await c.post("/v1/sessions")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.headers["x-request-id"].startswith("req_")  # (a refusal is logged and answered by its id too)
        assert r.json()["error"]["code"] == "draining" and set(r.json()["error"]) == {"code", "message"}
        assert (await c.get("/readyz")).status_code == 503
        assert (await c.get(f"/v1/sessions/{sid}/events")).status_code == 503
        assert sorted(await redis.keys("*")) == keys_before  # nothing made
        async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as late:
            async with asyncio.timeout(5):
                with contextlib.suppress(ConnectionClosed):
                    await late.recv()
            assert late.close_code == 1012
        assert (await c.get("/healthz")).status_code == 200
    assert drain.refused == 4
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(5):
        assert await drain.settled(0.05, loop.time() + 5)  # nothing open any more
    assert drain.open == 0

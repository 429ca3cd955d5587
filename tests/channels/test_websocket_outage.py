"""The websocket channel while Redis is gone and after it is back (killed with SIGKILL,
`appendfsync always`, restarted on the same port and data): a frame sent meanwhile gets an
error frame (or the socket a 1013 close), nothing is half-written, and the client that resends
with the same message_id after reconnecting with ?after= sees every event once, the outbox's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from app import create_app
from app.settings import Settings
from harness import Agent
from harness.models import ModelReply, ScriptedModel
from tests.conftest import LiveServer, ValkeyServer, free_port


def echo() -> Agent:
    return Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text=f"re {r.messages[-1].text}")))


@pytest.fixture
async def own_valkey() -> AsyncIterator[ValkeyServer]:
    server = ValkeyServer(fsync="always")
    server.start()
    yield server
    server.remove()


async def frames_until(ws: ClientConnection, stop: Any, timeout: float = 10) -> list[dict[str, Any]]:
    """Frames (heartbeats left out) until one for which `stop(frame)` holds."""
    out: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] != "heartbeat":
                out.append(frame)
                if stop(frame):
                    return out


def kill(server: ValkeyServer) -> None:
    assert server.proc is not None
    server.proc.kill()  # SIGKILL
    server.proc.wait(timeout=10)
    server.proc = None


async def history(live: LiveServer, sid: str) -> list[tuple[str, str]]:
    async with live.client() as c:
        items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
    return [(i["role"], i["text"]) for i in items]


async def outbox_ids(live: LiveServer, sid: str, n: int) -> list[str]:
    """The first `n` event ids of the session, as an SSE replay of its outbox gives them."""
    ids: list[str] = []
    async with live.client() as c, c.stream("GET", f"/v1/sessions/{sid}/events") as r:
        async for line in r.aiter_lines():
            if line.startswith("id: "):
                ids.append(line[4:])
                if len(ids) == n:
                    break
    return ids


def completed(mid: str) -> Any:
    return lambda f: f["type"] == "turn.completed" and f["data"].get("message_id") == mid


async def test_a_socket_through_a_redis_outage_loses_and_repeats_nothing(own_valkey: ValkeyServer) -> None:
    settings = Settings(sse_heartbeat=0.5)
    live = LiveServer(create_app(settings, redis_url=own_valkey.url, agent=echo()), free_port(), settings)
    await live.start()
    try:
        async with live.client() as c:
            sid = (await c.post("/v1/sessions")).json()["session_id"]
            others = [(await c.post("/v1/sessions")).json()["session_id"] for _ in range(4)]
            # turns at once elsewhere: keel holds several pooled connections when Redis dies
            await asyncio.gather(*(c.post(f"/v1/sessions/{o}/messages?wait=true", json={"text": "x"}) for o in others))
        url = f"{live.ws_base}/v1/sessions/{sid}/ws"
        seen: list[dict[str, Any]] = []
        async with connect(url) as ws:
            await ws.send(json.dumps({"type": "message", "text": "one", "message_id": "m1"}))
            seen += await frames_until(ws, completed("m1"))
            kill(own_valkey)
            await ws.send(json.dumps({"type": "message", "text": "two", "message_id": "m2", "ref": "r2"}))
            try:
                during = await frames_until(ws, lambda f: f["type"] == "error", timeout=15)
            except ConnectionClosed as closed:  # the socket's own reads failed first
                assert closed.rcvd is not None and closed.rcvd.code == 1013
            else:
                assert during[-1] == {
                    "type": "error",
                    "error": {"code": "unavailable", "message": "storage is unavailable; send the frame again"},
                    "ref": "r2",
                }
                seen += during[:-1]
        own_valkey.start()  # same port, same AOF
        after = seen[-1]["id"]
        async with connect(f"{url}?after={after}") as ws:  # as the widget does: resume, resend
            await ws.send(json.dumps({"type": "message", "text": "two", "message_id": "m2", "ref": "again"}))
            resumed = await frames_until(ws, completed("m2"), timeout=20)
            assert [f for f in resumed if f["type"] == "error"] == []  # Redis is back: no stale connection fails
            seen += resumed
            await ws.send(json.dumps({"type": "message", "text": "two", "message_id": "m2"}))  # a repeat: no turn
            await ws.send(json.dumps({"type": "ping", "ref": "p"}))
            assert await frames_until(ws, lambda f: f["type"] == "pong") == [{"type": "pong", "ref": "p"}]
        ids = [f["id"] for f in seen]
        assert [f["seq"] for f in seen] == list(range(1, len(seen) + 1))  # each event once, no gap
        assert [f["data"]["reply"] for f in seen if f["type"] == "turn.completed"] == ["re one", "re two"]
        assert await history(live, sid) == [
            ("user", "one"),
            ("assistant", "re one"),
            ("user", "two"),
            ("assistant", "re two"),
        ]
        assert await outbox_ids(live, sid, len(ids)) == ids  # the socket saw exactly the outbox, across the outage
    finally:
        await live.stop()

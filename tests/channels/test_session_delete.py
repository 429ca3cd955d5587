"""DELETE /v1/sessions/{id} over a real server: 204, the owner's only (another key's is 404 and
changes nothing), every key gone with the delivery relay's, a turn in progress stopped; SSE
streams and websockets of the session get `session.deleted` and end, in this process and in
another one; with KEEL_SESSION_TTL_DAYS (a few ms here), a session left alone disappears whole,
its delivery state with it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import connect

from app.settings import Settings, SettingsError
from harness.store.keys import DeliveryKeys, SessionKeys
from tests.channels.slack_support import echo_agent, eventually, relay_done
from tests.channels.test_deltas import sse_messages
from tests.channels.test_http import snapshot
from tests.channels.test_websocket import closed_with, frames_until
from tests.channels.webhook_receiver import Receiver
from tests.harness.session_keys import deadlines, keys_of


async def subscribe(c: httpx.AsyncClient, receiver: Receiver, path: str) -> str:
    r = await c.post("/v1/webhooks", json={"url": receiver.url(path), "events": ["*"]})
    assert r.status_code == 201, r.text
    receiver.expect(path, r.json()["secret"])
    return f"wh:{r.json()['id']}"


async def sse_until_end(lines: AsyncIterator[str], until: str = "") -> list[dict[str, str]]:
    """Raw SSE messages (their fields) until the stream ends (or an event of type `until`)."""
    return await sse_messages(lines, until)


async def test_delete_is_the_owners_and_removes_everything(serve: Any, redis: Redis, receiver: Receiver) -> None:
    live = await serve(echo_agent(), api_keys=("k1", "k2"), webhook_allow_private=True)
    async with live.client("k1") as c, live.client("k2") as other:
        dest = await subscribe(c, receiver, "all")
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "wipe disk"})
        assert r.json()["status"] == "waiting"
        await relay_done(redis)
        assert {SessionKeys(sid).pending, DeliveryKeys(sid, dest).state} <= await keys_of(redis, sid)

        before = await snapshot(redis)
        r = await other.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert await snapshot(redis) == before

        r = await c.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 204 and r.content == b""
        assert await keys_of(redis, sid) == set()
        for method, path in [("GET", ""), ("GET", "/history"), ("DELETE", ""), ("POST", "/compact")]:
            r = await c.request(method, f"/v1/sessions/{sid}{path}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", (method, path)
        r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "again"})
        assert r.status_code == 404
        await relay_done(redis)
        assert await keys_of(redis, sid) == set()


async def test_readers_are_told_and_end_a_turn_in_progress_stops(serve: Any, redis: Redis) -> None:
    gate = asyncio.Event()  # every model call waits: the turn is in progress when it is deleted
    live = await serve(echo_agent(gate=gate), sse_heartbeat=30)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        async with (
            c.stream("GET", f"/v1/sessions/{sid}/events") as sse,
            connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws,
        ):
            await frames_until(ws, "session.created")
            await ws.send(json.dumps({"type": "message", "text": "hi"}))
            await frames_until(ws, "turn.started")
            assert (await c.delete(f"/v1/sessions/{sid}")).status_code == 204
            frames = await frames_until(ws, "session.deleted", timeout=5)
            assert await closed_with(ws, 5) == 4404
            messages = await asyncio.wait_for(sse_until_end(sse.aiter_lines()), 5)  # the stream ended
        gate.set()
        assert frames[-1]["type"] == "session.deleted" and frames[-1]["session_id"] == sid
        assert frames[-1]["data"] == {"reason": "deleted"} and "id" not in frames[-1]
        assert messages[-1]["event"] == "session.deleted" and "id" not in messages[-1]
        told = json.loads(messages[-1]["data"])
        assert told.pop("at") <= frames[-1].pop("at") + 1 and told == frames[-1]  # (each reader its own `at`)
        assert [m["event"] for m in messages[:2]] == ["session.created", "message.received"]

        async def runner_done() -> bool:
            harness = live.app.state.harness
            return not harness.runner.runs(sid) and not await keys_of(redis, sid)

        await eventually(runner_done, 10)  # its cancel commit was refused: nothing made again
        async with c.stream("GET", f"/v1/sessions/{sid}/events") as r:
            assert r.status_code == 404  # (an EventSource reconnecting stops here)


async def test_a_reader_on_another_server_is_told(serve: Any, redis: Redis) -> None:
    one = await serve(echo_agent())
    two = await serve(echo_agent(), sse_heartbeat=30)  # its periodic look would come too late
    async with one.client() as c1, two.client() as c2:
        sid = (await c1.post("/v1/sessions")).json()["session_id"]
        async with c2.stream("GET", f"/v1/sessions/{sid}/events") as sse:
            lines = sse.aiter_lines()
            first = await asyncio.wait_for(sse_until_end(lines, "session.created"), 5)

            async def subscribed() -> bool:
                return bool((await redis.pubsub_shardnumsub(SessionKeys(sid).live))[0][1])

            await eventually(subscribed, 5)
            assert (await c1.delete(f"/v1/sessions/{sid}")).status_code == 204
            messages = first + await asyncio.wait_for(sse_until_end(lines), 5)
        assert [m["event"] for m in messages] == ["session.created", "session.deleted"]
        assert json.loads(messages[-1]["data"])["data"] == {"reason": "deleted"}


async def test_an_idle_session_expires_whole_with_its_delivery_state(
    serve: Any, redis: Redis, receiver: Receiver
) -> None:
    ttl = 1_500
    live = await serve(echo_agent(), api_keys=("k1",), webhook_allow_private=True, session_ttl_ms=ttl)
    async with live.client("k1") as c:
        dest = await subscribe(c, receiver, "all")
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hi"})
        assert r.json()["status"] == "completed"
        await relay_done(redis)
        at = await deadlines(redis, sid)
        assert DeliveryKeys(sid, dest).state in at and SessionKeys(sid).relays in at
        assert len(set(at.values())) == 1, at  # the delivery state expires with the session

        async def gone() -> bool:
            return not await keys_of(redis, sid)

        await eventually(gone, 10)
        r = await c.get(f"/v1/sessions/{sid}")
        assert r.status_code == 404


def test_the_session_ttl_setting() -> None:
    day = 86_400_000
    assert Settings().session_ttl_ms == Settings.from_env({}).session_ttl_ms == 30 * day
    assert Settings.from_env({"KEEL_SESSION_TTL_DAYS": "7"}).session_ttl_ms == 7 * day
    assert Settings.from_env({"KEEL_SESSION_TTL_DAYS": "0"}).session_ttl_ms == 0  # never
    for bad in ("-1", "1.5", "month"):
        with pytest.raises(SettingsError, match="KEEL_SESSION_TTL_DAYS"):
            Settings.from_env({"KEEL_SESSION_TTL_DAYS": bad})

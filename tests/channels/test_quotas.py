"""Quotas and backpressure (issue 16): a rate limit per API key, a bound on the messages waiting
in a session, on the readers of a session and on the websockets of a token. Past each: 429 with
Retry-After (or a websocket error frame / close 4429), and nothing written."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from harness.service.quotas import RateLimit
from tests.channels.slack_support import echo_agent, eventually

KEYS = ("key-one", "key-two")


async def session_keys(redis: Redis, sid: str) -> dict[bytes, Any]:
    """Every key of one session with its value: what a refused request must leave alone."""
    return {k: await redis.dump(k) for k in sorted(await redis.keys(f"keel:{{{sid}}}:*"))}


def authed(live: Any, key: str) -> httpx.AsyncClient:
    return live.client(key)


async def test_past_the_rate_limit_429_with_retry_after_and_nothing_written(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent(), api_keys=KEYS, rate_limit=RateLimit(3, 60))
    async with authed(live, "key-one") as c, authed(live, "key-two") as other:
        for _ in range(4):  # bad input is refused before the limit: it costs nothing
            assert (await c.post("/v1/sessions", content=b"{nope")).status_code == 400
        sid = (await c.post("/v1/sessions")).json()["session_id"]  # 1
        for n in (1, 2):  # 2, 3
            r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": f"m{n}"})
            assert r.status_code == 200 and r.json()["reply"] == f"re:m{n}"
        before = await session_keys(redis, sid)
        over = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "m3"})
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(over.headers["retry-after"]) <= 20  # 3 per minute: one token every 20 s
        assert (await c.post("/v1/sessions")).status_code == 429
        assert (await c.post(f"/v1/sessions/{sid}/tokens")).status_code == 429
        assert (await c.post(f"/v1/sessions/{sid}/compact")).status_code == 429
        assert await session_keys(redis, sid) == before
        assert (await c.get(f"/v1/sessions/{sid}")).status_code == 200  # reads are not counted
        assert (await other.post("/v1/sessions")).status_code == 201  # another key has its own bucket


async def test_the_rate_limit_on_a_websocket_is_an_error_frame_and_the_socket_stays(serve: Any) -> None:
    live = await serve(echo_agent(), rate_limit=RateLimit(2, 3600))
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]  # 1
    async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
        await ws.send(json.dumps({"type": "message", "text": "a", "ref": "r1"}))  # 2
        frames: list[dict[str, Any]] = []
        for n in range(25):  # more than the bad frames that close a socket: these are not bad
            await ws.send(json.dumps({"type": "message", "text": "b", "ref": f"x{n}"}))
        while len([f for f in frames if f.get("type") == "error"]) < 25:
            frames.append(json.loads(await asyncio.wait_for(ws.recv(), 5)))
        errors = [f for f in frames if f.get("type") == "error"]
        assert {e["error"]["code"] for e in errors} == {"rate_limited"}
        assert all(e["error"]["retry_after"] >= 1 for e in errors)
        await ws.send(json.dumps({"type": "ping", "ref": "p"}))
        while (frame := json.loads(await asyncio.wait_for(ws.recv(), 5))).get("type") != "pong":
            frames.append(frame)
    received = [f for f in frames if f.get("type") == "message.received"]
    assert len(received) == 1  # only the message within the limit


async def test_a_full_queue_is_429_queue_full_and_a_repeat_still_answers(serve: Any, redis: Redis) -> None:
    gate = asyncio.Event()
    live = await serve(echo_agent(gate=gate), max_queued=2)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        for n in range(3):  # the turn in progress and two waiting behind it
            r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": f"m{n}", "message_id": f"m{n}"})
            assert r.status_code == 202
        before = await session_keys(redis, sid)
        full = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "m3", "message_id": "m3"})
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        assert full.headers["retry-after"] == "1"
        assert (await c.post(f"/v1/sessions/{sid}/compact")).status_code == 429
        again = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "m2", "message_id": "m2"})
        assert again.status_code == 202  # a retry of a message already in is not refused
        assert await session_keys(redis, sid) == before
        assert (await c.get(f"/v1/sessions/{sid}")).json()["queued"] == 2
        gate.set()
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "m3", "message_id": "m3"})
        assert r.json()["reply"] == "re:m3"  # room again once the queue drained
        history = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
        assert [i["text"] for i in history if i["role"] == "user"] == ["m0", "m1", "m2", "m3"]


async def test_messages_steered_into_a_running_turn_count_against_the_queue(serve: Any, redis: Redis) -> None:
    """Steered messages no model call took yet wait too: past KEEL_MAX_QUEUED they are 429
    queue_full as queued ones are (a client cannot pile up messages on a running turn)."""
    gate = asyncio.Event()
    live = await serve(echo_agent(gate=gate), max_queued=2)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        assert (await c.post(f"/v1/sessions/{sid}/messages", json={"text": "m0"})).status_code == 202
        for n in (1, 2):
            r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": f"s{n}", "policy": "steer"})
            assert r.status_code == 202 and r.json()["handled"] == "steered", r.text
        before = await session_keys(redis, sid)
        full = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "s3", "policy": "steer"})
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        assert await session_keys(redis, sid) == before
        gate.set()
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "m4"})
        assert r.json()["reply"] == "re:m4"
        history = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
        assert [i["text"] for i in history if i["role"] == "user"] == ["m0", "s1", "s2", "m4"]


async def test_readers_of_a_session_are_bounded(serve: Any) -> None:
    live = await serve(echo_agent(), max_readers=2)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        other = (await c.post("/v1/sessions")).json()["session_id"]
        async with c.stream("GET", f"/v1/sessions/{sid}/events") as first:
            assert first.status_code == 200
            async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
                await ws.send(json.dumps({"type": "ping", "ref": "p"}))
                while json.loads(await asyncio.wait_for(ws.recv(), 5)).get("type") != "pong":
                    pass
                third = await c.get(f"/v1/sessions/{sid}/events")
                assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_readers"
                assert "retry-after" in third.headers
                with pytest.raises(ConnectionClosed) as closed:
                    async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as refused:
                        await asyncio.wait_for(refused.recv(), 5)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 4429
                async with c.stream("GET", f"/v1/sessions/{other}/events") as elsewhere:
                    assert elsewhere.status_code == 200  # another session has its own places

        async def admitted() -> bool:  # the places come back once the readers have gone
            async with c.stream("GET", f"/v1/sessions/{sid}/events") as again:
                return again.status_code == 200

        await eventually(admitted, 10)


async def test_websockets_per_token_are_bounded(serve: Any) -> None:
    live = await serve(echo_agent(), api_keys=KEYS, max_token_sockets=1)
    async with authed(live, "key-one") as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        token = (await c.post(f"/v1/sessions/{sid}/tokens")).json()["token"]
    url = f"{live.ws_base}/v1/sessions/{sid}/ws"
    async with connect(f"{url}?token={token}") as ws:
        await ws.send(json.dumps({"type": "ping", "ref": "p"}))
        while json.loads(await asyncio.wait_for(ws.recv(), 5)).get("type") != "pong":
            pass
        with pytest.raises(ConnectionClosed) as closed:
            async with connect(f"{url}?token={token}") as second:
                await asyncio.wait_for(second.recv(), 5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4429
        async with connect(url, additional_headers={"Authorization": "Bearer key-one"}) as keyed:
            await keyed.send(json.dumps({"type": "ping", "ref": "k"}))  # a key is not a token: not counted
            while json.loads(await asyncio.wait_for(keyed.recv(), 5)).get("type") != "pong":
                pass


async def test_token_minting_is_limited_per_session_by_default(serve: Any) -> None:
    live = await serve(echo_agent(), token_rate=RateLimit(3, 3600))  # (the default is 60/min)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        other = (await c.post("/v1/sessions")).json()["session_id"]
        for _ in range(3):
            assert (await c.post(f"/v1/sessions/{sid}/tokens")).status_code == 201
        over = await c.post(f"/v1/sessions/{sid}/tokens")
        assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limited"
        assert int(over.headers["retry-after"]) >= 1
        assert (await c.post(f"/v1/sessions/{other}/tokens")).status_code == 201  # per session
    from app.settings import Settings

    assert str(Settings().token_rate) == "60/min" and Settings.from_env({}).token_rate == Settings().token_rate
    assert Settings.from_env({"KEEL_TOKEN_RATE_LIMIT": "off"}).token_rate is None


async def test_bad_input_spends_no_rate_limit_token(serve: Any) -> None:
    """Refused as bad input (400) or for a session that is not there (404): no token taken, on
    every route the rate limit counts (messages, compactions, frontend messages, websocket)."""
    live = await serve(echo_agent(), api_keys=KEYS, rate_limit=RateLimit(3, 60))
    async with authed(live, KEYS[0]) as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]  # (1 of 3)
        for _ in range(4):
            bad = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hi", "message_id": "a b"})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_message_id"
            gone = await c.post("/v1/sessions/ses_0000000000000000000000000/messages", json={"text": "hi"})
            assert gone.status_code == 404
            assert (await c.post("/v1/sessions/ses_0000000000000000000000000/compact")).status_code == 404
            chat = {"id": sid, "messages": [{"id": "a b", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]}
            assert (await c.post("/v1/chat", json=chat)).status_code == 400
        async with connect(
            f"{live.ws_base}/v1/sessions/{sid}/ws", additional_headers={"Authorization": f"Bearer {KEYS[0]}"}
        ) as ws:
            for _ in range(3):
                await ws.send(json.dumps({"type": "message", "text": "hi", "message_id": "a b", "ref": "r"}))
                frame = json.loads(await asyncio.wait_for(ws.recv(), 5))
                while frame.get("type") != "error":
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 5))
                assert frame["error"]["code"] == "invalid_message_id"
        ok = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hi"})  # (2 of 3)
        assert ok.status_code == 202, ok.text
        assert (await c.post(f"/v1/sessions/{sid}/compact")).status_code == 202  # (3 of 3)
        over = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hi"})
        assert over.status_code == 429

"""The websocket channel over a real server (uvicorn, websockets-sansio): events as SSE sends
them, resume without gap or duplicate (across a server restart too), error frames, auth with
keys and signed tokens, origins, limits, a slow consumer, and 1012 on shutdown."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from channels.tokens import TokenSigner
from harness import Agent, ToolContext, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall


def agent(reply_size: int = 0) -> Agent:
    @tool(approval=True)
    def refund(amount: int, ctx: ToolContext) -> str:
        """Refund an order."""
        return f"refunded {amount}"

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "user" and last.text.startswith("refund "):
            return ModelReply(tool_calls=[ToolCall("refund", {"amount": int(last.text[7:])})])
        ctx = [m.text.split("\n", 1)[1] for m in r.messages if m.kind in ("context", "sticky")]
        return ModelReply(text=f"re {last.text} ctx={ctx}" + "z" * reply_size)

    return Agent(instructions="t", tools=[refund], model=ScriptedModel(script))


async def frames_until(ws: ClientConnection, etype: str, timeout: float = 10) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] == "heartbeat":
                continue
            out.append(frame)
            if frame["type"] == etype:
                return out


async def sse_raw(c: httpx.AsyncClient, sid: str, count: int) -> list[str]:
    out: list[str] = []
    async with c.stream("GET", f"/v1/sessions/{sid}/events") as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                if len(out) == count:
                    return out
    raise AssertionError("the stream ended")


async def closed_with(ws: ClientConnection, timeout: float = 10) -> int | None:
    """Read until the server closes; its close code."""
    with pytest.raises(ConnectionClosed) as info:
        async with asyncio.timeout(timeout):
            while True:
                await ws.recv()
    rcvd = info.value.rcvd
    return rcvd.code if rcvd is not None else None


async def test_a_turn_over_the_socket_sends_the_sse_envelopes_byte_for_byte(serve: Any) -> None:
    live = await serve(agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
            raw_created = await ws.recv()
            assert json.loads(raw_created)["type"] == "session.created"
            await ws.send(
                json.dumps({"type": "message", "text": "hi", "context": {"page": "/orders"}, "message_id": "m1"})
            )
            raw = [raw_created]
            async with asyncio.timeout(10):
                while json.loads(raw[-1])["type"] != "turn.completed":
                    raw.append(str(await ws.recv()))
        assert [json.loads(x)["type"] for x in raw] == [
            "session.created",
            "message.received",
            "turn.started",
            "usage.recorded",
            "message.completed",
            "turn.completed",
        ]
        assert json.loads(raw[-1])["data"]["reply"] == "re hi ctx=['/orders']"
        assert await sse_raw(c, sid, len(raw)) == raw  # the same bytes as SSE sends


async def test_resume_after_an_event_with_no_gap_or_duplicate_across_a_restart(serve: Any) -> None:
    first = await serve(agent())
    async with first.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "one"})
        async with connect(f"{first.ws_base}/v1/sessions/{sid}/ws") as ws:
            seen = await frames_until(ws, "turn.completed")
        port = first.port
    await first.stop()
    second = await serve(agent(), port=port)  # a new server process state, same port and Redis
    async with second.client() as c:
        await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "two"})
        async with connect(f"{second.ws_base}/v1/sessions/{sid}/ws?after={seen[2]['id']}") as ws:
            rest = await frames_until(ws, "turn.completed")
            rest += await frames_until(ws, "turn.completed")
        all_ids = [e["id"] for e in seen[:3] + rest]
        assert len(all_ids) == len(set(all_ids))
        everything = [json.loads(x) for x in await sse_raw(c, sid, len(all_ids))]
        assert [e["id"] for e in everything] == all_ids  # exactly the outbox, in order
        assert [e["seq"] for e in everything] == list(range(1, len(all_ids) + 1))


async def test_bad_frames_get_error_frames_and_the_socket_stays(serve: Any) -> None:
    live = await serve(agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
    async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
        await frames_until(ws, "session.created")
        bad = [
            ("{not json", "invalid_frame"),
            ('{"type": "shout"}', "invalid_frame"),
            ('{"type": "message", "text": ""}', "invalid_frame"),
            ('{"type": "message", "text": "a", "context": 5}', "invalid_frame"),
            ('{"type": "message", "text": "a", "message_id": "has space", "ref": "r7"}', "invalid_message_id"),
            ('{"type": "respond", "request_id": "req_nope", "decision": "approve"}', "request_not_found"),
            ('{"type": "respond", "request_id": "req_nope", "decision": "maybe"}', "invalid_decision"),
            ('{"type": "cancel"}', "nothing_to_cancel"),
        ]
        for text, code in bad:
            await ws.send(text)
            frame = json.loads(await ws.recv())
            assert frame["type"] == "error" and frame["error"]["code"] == code, (text, frame)
            assert frame["error"]["message"]
        await ws.send('{"type": "ping", "ref": "p1"}')
        assert json.loads(await ws.recv()) == {"type": "pong", "ref": "p1"}
        await ws.send(json.dumps({"type": "message", "text": "still here"}))
        frames = await frames_until(ws, "turn.completed")
        assert frames[-1]["data"]["reply"].startswith("re still here")
    async with live.client() as c:  # nothing the bad frames said was written
        items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
        assert [i["text"] for i in items if i["role"] == "user"] == ["still here"]


async def test_abusive_frames_close_the_socket(serve: Any) -> None:
    live = await serve(agent(), ws_max_frame=2048)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
    url = f"{live.ws_base}/v1/sessions/{sid}/ws"
    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "message", "text": "x" * 5000}))
        assert await closed_with(ws) == 1009
    async with connect(url) as ws:
        await ws.send(b"\x00\x01")
        assert await closed_with(ws) == 1003
    async with connect(url) as ws:
        for _ in range(25):
            await ws.send("nope")
        assert await closed_with(ws) == 1008
    async with live.client() as c:
        assert (await c.get(f"/v1/sessions/{sid}/history")).json()["items"] == []


async def test_approve_from_the_socket(serve: Any) -> None:
    live = await serve(agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
    async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
        await ws.send(json.dumps({"type": "message", "text": "refund 12"}))
        asked = (await frames_until(ws, "input.requested"))[-1]["data"]["requests"][0]
        assert asked["tool"] == "refund" and asked["arguments"] == {"amount": 12}
        await ws.send(json.dumps({"type": "respond", "request_id": asked["request_id"], "decision": "approve"}))
        frames = await frames_until(ws, "turn.completed")
        types = [f["type"] for f in frames]
        assert types[0] == "input.resolved" and "tool.completed" in types
        await ws.send(json.dumps({"type": "respond", "request_id": asked["request_id"], "decision": "deny"}))
        frame = json.loads(await ws.recv())
        assert frame["error"]["code"] == "already_answered"


async def test_keys_tokens_and_unknown_sessions(serve: Any) -> None:
    live = await serve(agent(), api_keys=("key-a", "key-b"), token_ttl=60)
    async with live.client("key-a") as a, live.client("key-b") as b:
        sid = (await a.post("/v1/sessions")).json()["session_id"]
        other = (await b.post("/v1/sessions")).json()["session_id"]
        r = await a.post(f"/v1/sessions/{sid}/tokens")
        assert r.status_code == 201 and r.json()["expires_at"] > time.time() + 50
        token = r.json()["token"]
        assert (await b.post(f"/v1/sessions/{sid}/tokens")).status_code == 404  # not b's session
        assert (await a.post("/v1/sessions/ses_00000000000000000000000000/tokens")).status_code == 404
    url = f"{live.ws_base}/v1/sessions/{sid}/ws"
    async with connect(url, additional_headers={"Authorization": "Bearer key-a"}) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
    async with connect(f"{url}?token={token}") as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
    signer: TokenSigner = live.app.state.tokens
    expired, _ = signer.mint(sid, token_owner(signer, token, sid), now=time.time() - 120)
    body, _, mac = token.partition(".")
    refused = {
        "no key": (url, {}),
        "wrong key": (url, {"Authorization": "Bearer key-x"}),
        "token of another session": (f"{live.ws_base}/v1/sessions/{other}/ws?token={token}", {}),
        "expired token": (f"{url}?token={expired}", {}),
        "forged token": (f"{url}?token={body}.{mac[::-1]}", {}),
        "garbage token": (f"{url}?token=abc", {}),
    }
    for what, (target, headers) in refused.items():
        async with connect(target, additional_headers=headers) as ws:
            assert await closed_with(ws) == 4401, what
    async with connect(
        f"{live.ws_base}/v1/sessions/{other}/ws", additional_headers={"Authorization": "Bearer key-a"}
    ) as ws:
        assert await closed_with(ws) == 4404  # b's session does not exist for a
    async with connect(f"{url}?after=not-an-id", additional_headers={"Authorization": "Bearer key-a"}) as ws:
        assert await closed_with(ws) == 4400


def token_owner(signer: TokenSigner, token: str, sid: str) -> str:
    owner = signer.verify(token, sid)
    assert owner is not None
    return owner


async def test_origins(serve: Any) -> None:
    listed = await serve(agent(), allowed_origins=("https://shop.example",))
    default = await serve(agent())
    for live, allowed, refused in (
        (listed, ["https://shop.example"], ["https://evil.example", f"http://127.0.0.1:{listed.port}"]),
        (default, [f"http://127.0.0.1:{default.port}"], ["https://evil.example", "null"]),
    ):
        async with live.client() as c:
            sid = (await c.post("/v1/sessions")).json()["session_id"]
        url = f"{live.ws_base}/v1/sessions/{sid}/ws"
        for origin in allowed:
            async with connect(url, origin=origin) as ws:  # type: ignore[arg-type]
                assert json.loads(await ws.recv())["type"] == "session.created"
        for origin in refused:
            async with connect(url, origin=origin) as ws:  # type: ignore[arg-type]
                assert await closed_with(ws) == 4403, origin


async def test_a_client_that_stops_reading_is_closed_with_1013(serve: Any) -> None:
    live = await serve(agent(reply_size=60_000), ws_send_queue=4, ws_slow_s=0.3)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws", max_size=None, max_queue=1) as ws:
            n = 0
            async with asyncio.timeout(30):
                while live.app.state.ws_stats.closed.get(1013, 0) == 0:  # the server gives up on it
                    await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": f"m{n}"})
                    n += 1
            got: list[str] = []
            with pytest.raises(ConnectionClosed) as info:
                async with asyncio.timeout(20):
                    while True:
                        got.append(str(await ws.recv()))
            assert info.value.rcvd is not None and info.value.rcvd.code == 1013
        outbox = [json.loads(x)["id"] for x in await sse_raw(c, sid, len(got))]
        assert [json.loads(x)["id"] for x in got] == outbox  # what it got is a gapless prefix
        assert (await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "after"})).status_code == 200


async def test_shutdown_closes_sockets_with_1012(serve: Any) -> None:
    live = await serve(agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
    async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
        await frames_until(ws, "session.created")
        stopping = asyncio.create_task(live.stop())
        assert await closed_with(ws) == 1012
        await stopping


async def test_heartbeat_frames_when_idle(serve: Any) -> None:
    live = await serve(agent(), ws_heartbeat=0.2)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
    async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
        await frames_until(ws, "session.created")
        async with asyncio.timeout(5):
            frame = json.loads(await ws.recv())
        assert frame["type"] == "heartbeat" and frame["at"] > 0

"""message.delta: a reply's text as the model streams it, to the readers connected now (SSE,
websocket, another process's readers through pub/sub), never stored, never replayed, no SSE id."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis
from websockets.asyncio.client import connect

from harness import Agent, Harness
from harness.events import LiveEvent, StoredEvent
from harness.models import ModelReply, ModelRequest, ScriptedModel
from harness.store.keys import SessionKeys
from tests.channels.slack_support import eventually
from tests.conftest import channel_client

REPLY = "a reply that streams in pieces, é and 🙂 included"


def streaming_agent(gate: asyncio.Event | None = None) -> Agent:
    async def script(r: ModelRequest) -> ModelReply:
        if gate is not None:
            await gate.wait()
        return ModelReply(text=REPLY)

    return Agent(instructions="t", model=ScriptedModel(script, chunk=7))


async def sse_messages(lines: AsyncIterator[str], until: str) -> list[dict[str, str]]:
    """Raw SSE messages (their fields) until an event of type `until`."""
    out: list[dict[str, str]] = []
    fields: dict[str, str] = {}
    async for line in lines:
        if line == "":
            if "data" in fields:
                out.append(fields)
                if fields["event"] == until:
                    return out
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value
    return out


def check_deltas(deltas: list[dict[str, Any]], completed: dict[str, Any]) -> None:
    """In order, contiguous (offsets), of the completed item, adding up to its text."""
    assert deltas, "no message.delta reached the reader"
    assert {d["data"]["item_id"] for d in deltas} == {completed["data"]["item_id"]}
    offset = 0
    for d in deltas:
        assert d["data"]["offset"] == offset and "id" not in d and "seq" not in d
        offset += len(d["data"]["delta"])
    assert "".join(d["data"]["delta"] for d in deltas) == completed["data"]["text"] == REPLY


async def test_sse_readers_get_deltas_live_without_ids_and_never_again(serve: Any) -> None:
    gate = asyncio.Event()
    live = await serve(streaming_agent(gate))
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        async with c.stream("GET", f"/v1/sessions/{sid}/events") as resp:
            lines = resp.aiter_lines()
            messages = await asyncio.wait_for(sse_messages(lines, "session.created"), 5)  # the reader is in place
            await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hi"})
            gate.set()
            messages += await asyncio.wait_for(sse_messages(lines, "turn.completed"), 10)
        deltas = [json.loads(m["data"]) for m in messages if m["event"] == "message.delta"]
        assert all("id" not in m for m in messages if m["event"] == "message.delta")  # no `id:` line
        committed = [m for m in messages if m["event"] != "message.delta"]
        assert all("id" in m for m in committed)
        (completed,) = [json.loads(m["data"]) for m in committed if m["event"] == "message.completed"]
        check_deltas(deltas, completed)
        position = [m["event"] for m in messages]
        assert max(i for i, e in enumerate(position) if e == "message.delta") < position.index("message.completed")

        # a reader that comes later, or resumes, gets the committed events only
        async with c.stream("GET", f"/v1/sessions/{sid}/events") as resp:
            again = await asyncio.wait_for(sse_messages(resp.aiter_lines(), "turn.completed"), 10)
        assert [m["event"] for m in again] == [m["event"] for m in committed]
        assert [m["data"] for m in again] == [m["data"] for m in committed]  # byte for byte


async def test_websocket_readers_get_the_same_deltas(serve: Any) -> None:
    gate = asyncio.Event()
    live = await serve(streaming_agent(gate))
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
    async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
        assert json.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "session.created"  # reader in place
        await ws.send(json.dumps({"type": "message", "text": "hi"}))
        gate.set()
        frames: list[dict[str, Any]] = [{"type": "session.created"}]
        async with asyncio.timeout(10):
            while not frames or frames[-1]["type"] != "turn.completed":
                frames.append(json.loads(await ws.recv()))
    (completed,) = [f for f in frames if f["type"] == "message.completed"]
    check_deltas([f for f in frames if f["type"] == "message.delta"], completed)


async def test_a_reader_in_another_process_gets_the_deltas(make_harness: Any, redis: Redis, valkey: Any) -> None:
    gate = asyncio.Event()
    runner = await make_harness(streaming_agent(gate))
    # its own hub, pub/sub and Redis client, as in another process (two harnesses on one client
    # is not a thing keel does; on one redis-py client, this reader missed the deltas 2 runs in 5)
    reader = Harness.connect(valkey.url, streaming_agent(), run_turns=False)
    await reader.start()
    try:
        sid = await runner.sessions.create("o")
        got: list[StoredEvent | LiveEvent] = []
        subscribed = asyncio.Event()

        async def read() -> None:
            async for event in reader.sessions.tail(sid, "0-0", heartbeat=0.2):
                if event is None:
                    subscribed.set()  # (the first heartbeat comes after the subscription)
                    continue
                got.append(event)
                if event.type == "turn.completed":
                    return

        task = asyncio.create_task(read())
        await asyncio.wait_for(subscribed.wait(), 5)
        channel = f"keel:{{{sid}}}:live"
        async with channel_client(redis, channel) as node, asyncio.timeout(5):  # the reader's process is subscribed
            while not (await node.pubsub_shardnumsub(channel))[0][1]:  # noqa: ASYNC110 (Redis state)
                await asyncio.sleep(0.01)
        # ... and named as one of its readers: live events go out only to processes named so
        await eventually(lambda: redis.hexists(SessionKeys(sid).readers, reader.store.origin), 5)
        await runner.sessions.submit(sid, "o", "hi")
        gate.set()
        await asyncio.wait_for(task, 10)
    finally:
        await reader.stop()
    deltas = [json.loads(e.raw) for e in got if isinstance(e, LiveEvent)]
    (completed,) = [json.loads(e.raw) for e in got if e.type == "message.completed"]
    check_deltas(deltas, completed)
    stored = await runner.store.outbox.events(sid, "0-0")
    assert "message.delta" not in {e.type for e in stored}
    assert [i.text for i in await runner.sessions.history(sid, "o")] == ["hi", REPLY]


async def test_a_live_event_another_version_sends_is_skipped_not_fatal(make_harness: Any, redis: Redis) -> None:
    """During a rolling deploy a newer process may send a live event type this one does not know:
    it is skipped, and the live events after it, on the same message, still reach the readers."""
    h = await make_harness(streaming_agent(), run_turns=False)
    sid = await h.sessions.create("o")
    got: list[LiveEvent] = []
    tail = h.sessions.tail(sid, "0-0", heartbeat=0.2)
    try:
        channel = f"keel:{{{sid}}}:live"
        unknown = b'{"type":"message.thought","session_id":"%s","turn_id":"t","at":1.0,"data":{}}' % sid.encode()
        known = (
            b'{"type":"message.delta","session_id":"%s","turn_id":"t","at":1.0,'
            b'"data":{"item_id":"it_1","delta":"hi","offset":0}}' % sid.encode()
        )
        async with channel_client(redis, channel) as node:
            async with asyncio.timeout(5):  # this process is subscribed to the session's live events
                while not (await node.pubsub_shardnumsub(channel))[0][1]:
                    await anext(tail)
            await node.execute_command("SPUBLISH", channel, b"elsewhere " + unknown + b"\n" + known)
        async with asyncio.timeout(5):
            while not got:
                event = await anext(tail)
                if isinstance(event, LiveEvent):
                    got.append(event)
    finally:
        await tail.aclose()  # type: ignore[attr-defined]
    assert [e.raw for e in got] == [known]


async def test_a_reader_cancelled_while_it_subscribes_ends(make_harness: Any) -> None:
    """redis-py sends SUBSCRIBE inside wait_for, which on Python 3.11 can swallow a cancellation:
    a reader cancelled at any moment of its opening must still end."""
    h = await make_harness(streaming_agent(), run_turns=False)
    sid = await h.sessions.create("o")

    async def read() -> None:
        async for _ in h.sessions.tail(sid, "0-0", heartbeat=5):
            pass

    for steps in range(8):  # cancel after 0, 1, 2, ... turns of the event loop
        reader = asyncio.create_task(read())
        for _ in range(steps):
            await asyncio.sleep(0)
        reader.cancel()
        done, _ = await asyncio.wait([reader], timeout=2)
        assert done, f"a reader cancelled {steps} loop turns after it opened ran on"

"""A message sent while a turn runs or waits, over a real server, by its `policy`: `queue` (it
waits its turn), `steer` (it joins the running turn before its next model call, once, with a
`message.steered` event; a turn that ends before another model call runs it next as a turn of its
own; a turn waiting for approval is not steered), `interrupt` (the turn in progress ends as a
cancel ends it, and the message runs next, before others queued), `reject` (409 `busy`,
nothing written). A message that arrives when nothing runs starts a turn whatever its policy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import connect

from harness import Agent, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from tests.channels.test_fork import dumped
from tests.channels.test_http import snapshot
from tests.channels.test_websocket import frames_until


class Gated:
    """An agent whose `work` tool and `think` replies wait for the test: "work" calls the tool
    (then answers with every user text it sees), "think" waits before it answers, "wipe X"
    asks for approval; anything else is echoed. Every model request's user texts are kept."""

    def __init__(self) -> None:
        self.tool_began = asyncio.Event()
        self.tool_go = asyncio.Event()
        self.think_began = asyncio.Event()
        self.think_go = asyncio.Event()
        self.seen: list[list[str]] = []  # the user texts of each model request

        @tool
        async def work() -> str:
            """Do some work."""
            self.tool_began.set()
            await self.tool_go.wait()
            return "worked"

        @tool(approval=True)
        def wipe(target: str) -> str:
            """Wipe a target."""
            return f"wiped {target}"

        async def script(r: ModelRequest) -> ModelReply:
            users = [i.text for i in r.messages if i.role == "user" and i.kind == "message"]
            self.seen.append(users)
            last = r.messages[-1]
            # (a user item right after a tool result of its own turn: a message steered in)
            steered = len(r.messages) > 1 and r.messages[-2].role == "tool" and r.messages[-2].turn_id == last.turn_id
            if last.role == "tool" or (last.role == "user" and steered):
                return ModelReply(text="done, seen: " + " | ".join(users))
            if last.text == "work":
                return ModelReply(tool_calls=[ToolCall("work", {})])
            if last.text.startswith("wipe "):
                return ModelReply(tool_calls=[ToolCall("wipe", {"target": last.text[5:]})])
            if last.text == "think":
                self.think_began.set()
                await self.think_go.wait()
            return ModelReply(text=f"re:{last.text}")

        self.agent = Agent(instructions="t", tools=[work, wipe], model=ScriptedModel(script))


@pytest.fixture
async def keel(serve: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Gated, Any]]:
    gated = Gated()
    live = await serve(gated.agent)
    async with live.client() as c:
        yield c, gated, live


async def session(c: httpx.AsyncClient) -> str:
    sid: str = (await c.post("/v1/sessions")).json()["session_id"]
    return sid


async def send(c: httpx.AsyncClient, sid: str, text: str, policy: str = "queue", **extra: Any) -> httpx.Response:
    return await c.post(f"/v1/sessions/{sid}/messages", json={"text": text, "policy": policy, **extra})


async def settled(c: httpx.AsyncClient, sid: str, turns: int, timeout: float = 10) -> list[dict[str, Any]]:
    """The session's events once `turns` turns have ended (read from the start, SSE)."""
    events: list[dict[str, Any]] = []
    ends = 0
    async with asyncio.timeout(timeout), c.stream("GET", f"/v1/sessions/{sid}/events") as sse:
        async for line in sse.aiter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "message.delta":
                    continue
                events.append(event)
                ends += event["type"] in ("turn.completed", "turn.cancelled", "turn.failed")
                if ends == turns:
                    return events
    raise AssertionError("the stream ended")


async def texts(c: httpx.AsyncClient, sid: str) -> list[tuple[str, str]]:
    items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
    return [(i["role"], i["text"]) for i in items if i["kind"] in ("message", "tool_result")]


async def test_steer_joins_the_running_turn_before_its_next_model_call(keel: Any) -> None:
    c, g, _ = keel
    sid = await session(c)
    assert (await send(c, sid, "work")).json()["handled"] == "queued"
    await asyncio.wait_for(g.tool_began.wait(), 5)  # the turn runs its tool: a model call is next
    r = await send(c, sid, "also check the logs", "steer", message_id="m-steer")
    assert r.status_code == 202 and r.json()["handled"] == "steered"
    g.tool_go.set()
    events = await settled(c, sid, 1)
    turn = events[1]["turn_id"]
    steered = [e for e in events if e["type"] == "message.steered"]
    assert len(steered) == 1 and steered[0]["turn_id"] == turn
    assert steered[0]["data"] == {"message_id": "m-steer", "text": "also check the logs"}
    # recorded before it was acknowledged: its event comes before the tool's result
    order = [e["type"] for e in events]
    assert order.index("message.steered") < order.index("tool.completed")
    # the next model call saw it once, after the tool's result; it never ran as a turn of its own
    assert g.seen[-1] == ["work", "also check the logs"]
    assert events[-1]["data"]["reply"] == "done, seen: work | also check the logs"
    assert not any(e["type"] == "message.received" and e["data"]["message_id"] == "m-steer" for e in events)
    assert await texts(c, sid) == [
        ("user", "work"),
        ("assistant", ""),
        ("tool", "worked"),
        ("user", "also check the logs"),
        ("assistant", "done, seen: work | also check the logs"),
    ]
    assert (await c.get(f"/v1/sessions/{sid}")).json()["usage"]["model_calls"] == 2
    # the same message again is the same message: no second steer, no turn
    again = await send(c, sid, "also check the logs", "steer", message_id="m-steer")
    assert again.status_code == 202
    assert len(await texts(c, sid)) == 5


async def test_a_steered_message_the_turn_ends_before_taking_runs_next(keel: Any) -> None:
    c, g, _ = keel
    sid = await session(c)
    await send(c, sid, "think")
    await asyncio.wait_for(g.think_began.wait(), 5)  # its only model call is under way
    assert (await send(c, sid, "and then?", "steer", message_id="m-2")).json()["handled"] == "steered"
    g.think_go.set()
    events = await settled(c, sid, 2)
    received = [e for e in events if e["type"] == "message.received"]
    assert [e["data"]["text"] for e in received] == ["think", "and then?"]
    assert received[1]["turn_id"] != received[0]["turn_id"]  # a turn of its own
    assert await texts(c, sid) == [
        ("user", "think"),
        ("assistant", "re:think"),
        ("user", "and then?"),
        ("assistant", "re:and then?"),
    ]
    # the message's record now names its own turn: a resend of it is that turn
    r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "and then?", "message_id": "m-2"})
    assert r.json()["status"] == "completed" and r.json()["reply"] == "re:and then?"


async def test_a_steered_wait_follows_the_turn_the_message_ran_in(keel: Any) -> None:
    c, g, _ = keel
    sid = await session(c)
    await send(c, sid, "think")
    await asyncio.wait_for(g.think_began.wait(), 5)
    async with asyncio.timeout(10), c.stream("GET", f"/v1/sessions/{sid}/events") as sse:
        body = {"text": "later", "policy": "steer"}
        waiting = asyncio.create_task(c.post(f"/v1/sessions/{sid}/messages?wait=true", json=body))
        async for line in sse.aiter_lines():  # (until the steer is recorded)
            if line == "event: message.steered":
                break
    g.think_go.set()  # the turn ends before another model call: "later" runs as its own turn
    r = await asyncio.wait_for(waiting, 10)
    assert r.json()["status"] == "completed" and r.json()["reply"] == "re:later"


@pytest.mark.parametrize("policy", ["steer", "queue"])
async def test_a_turn_waiting_for_approval_is_not_steered(keel: Any, policy: str) -> None:
    c, _, _ = keel
    sid = await session(c)
    r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "wipe disk"})
    assert r.json()["status"] == "waiting"
    assert (await send(c, sid, "meanwhile", policy)).json()["handled"] == "queued"
    (request,) = (await c.get(f"/v1/sessions/{sid}")).json()["pending"]
    await c.post(f"/v1/sessions/{sid}/responses", json={"request_id": request["request_id"], "decision": "approve"})
    await settled(c, sid, 2)
    assert await texts(c, sid) == [
        ("user", "wipe disk"),
        ("assistant", ""),
        ("tool", "wiped disk"),
        ("assistant", "done, seen: wipe disk"),
        ("user", "meanwhile"),
        ("assistant", "re:meanwhile"),
    ]


async def test_interrupt_ends_the_running_turn_and_runs_next(keel: Any) -> None:
    c, g, _ = keel
    sid = await session(c)
    await send(c, sid, "think")
    await asyncio.wait_for(g.think_began.wait(), 5)
    await send(c, sid, "queued before")  # (waits behind the turn)
    r = await send(c, sid, "no, this", "interrupt")
    assert r.status_code == 202 and r.json()["handled"] == "interrupting"
    events = await settled(c, sid, 3)
    ends = [
        (e["type"], e["data"].get("reply"))
        for e in events
        if e["type"].startswith("turn.") and e["type"] != "turn.started"
    ]
    assert ends == [("turn.cancelled", None), ("turn.completed", "re:no, this"), ("turn.completed", "re:queued before")]
    assert not g.think_go.is_set()  # the model call was stopped, not waited out
    assert (await c.get(f"/v1/sessions/{sid}")).json()["status"] == "idle"


async def test_interrupt_ends_a_turn_waiting_for_approval(keel: Any) -> None:
    c, _, _ = keel
    sid = await session(c)
    r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "wipe disk"})
    assert r.json()["status"] == "waiting"
    r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "forget it", "policy": "interrupt"})
    assert r.json()["status"] == "completed" and r.json()["reply"] == "re:forget it"
    info = (await c.get(f"/v1/sessions/{sid}")).json()
    assert info["status"] == "idle" and info["pending"] == []
    events = await settled(c, sid, 2)
    assert [e["data"]["decision"] for e in events if e["type"] == "input.resolved"] == ["withdrawn"]
    assert ("tool", "wiped disk") not in await texts(c, sid)


async def test_reject_refuses_while_a_turn_runs_or_waits_and_writes_nothing(keel: Any, redis: Redis) -> None:
    c, g, _ = keel
    sid = await session(c)
    r = await send(c, sid, "hello", "reject")  # nothing runs: it starts a turn
    assert r.status_code == 202
    await settled(c, sid, 1)
    await send(c, sid, "think")
    await asyncio.wait_for(g.think_began.wait(), 5)
    before = await dumped(redis, sid)  # (the session's keys: the job stream moves with the runner's work)
    r = await send(c, sid, "not now", "reject")
    assert r.status_code == 409 and r.json()["error"]["code"] == "busy"
    assert await dumped(redis, sid) == before
    g.think_go.set()
    await settled(c, sid, 2)
    r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "wipe disk"})
    assert r.json()["status"] == "waiting"
    before = await dumped(redis, sid)
    r = await send(c, sid, "not now either", "reject")
    assert r.status_code == 409 and r.json()["error"]["code"] == "busy"
    assert await dumped(redis, sid) == before


async def test_a_bad_policy_is_refused(keel: Any, redis: Redis) -> None:
    c, _, _ = keel
    sid = await session(c)
    before = await snapshot(redis)
    r = await send(c, sid, "hi", "sometimes")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert await snapshot(redis) == before


async def test_the_websocket_frame_takes_a_policy(keel: Any) -> None:
    c, g, live = keel
    sid = await session(c)
    async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
        await frames_until(ws, "session.created")
        await ws.send(json.dumps({"type": "message", "text": "work"}))
        await asyncio.wait_for(g.tool_began.wait(), 5)
        await ws.send(json.dumps({"type": "message", "text": "steered in", "policy": "steer"}))
        await frames_until(ws, "message.steered")
        g.tool_go.set()
        done = await frames_until(ws, "turn.completed")
        assert done[-1]["data"]["reply"] == "done, seen: work | steered in"
        await ws.send(json.dumps({"type": "message", "text": "x", "policy": "maybe", "ref": "r1"}))
        error = await frames_until(ws, "error")
        assert error[-1]["error"]["code"] == "invalid_frame"


async def test_a_wait_past_its_timeout_answers_pending_with_the_turn_so_far(keel: Any) -> None:
    """`?wait=true&timeout=` ends at its timeout with `pending` (and any of the turn's events
    it read); the same message sent again (its id) waits on for the same turn, which then
    answers."""
    c, gated, _ = keel
    sid = await session(c)
    url = f"/v1/sessions/{sid}/messages?wait=true"
    r = await c.post(url + "&timeout=0.3", json={"text": "think", "message_id": "m-think"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "pending" and body["reply"] is None
    assert gated.think_began.is_set()
    gated.think_go.set()
    again = (await c.post(url, json={"text": "think", "message_id": "m-think"})).json()
    assert again["status"] == "completed" and again["reply"] == "re:think"
    assert [e["type"] for e in again["events"]][-2:] == ["message.completed", "turn.completed"]
    assert body["events"] == again["events"][: len(body["events"])]  # (the same turn, from its message on)

"""Approval answers and cancel over HTTP: the documented codes, and nothing changed on error."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from harness import Agent, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from tests.channels.test_http import jobs_done, snapshot


def agent(ran: list[str]) -> Agent:
    @tool(approval=True)
    def wipe(target: str) -> str:
        """Wipe a target."""
        ran.append(target)
        return f"wiped {target}"

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "user" and last.text.startswith("wipe "):
            return ModelReply(tool_calls=[ToolCall("wipe", {"target": last.text[5:]})])
        return ModelReply(text=f"re:{last.text}")

    return Agent(instructions="t", tools=[wipe], model=ScriptedModel(script))


async def test_approve_over_http(serve: Any) -> None:
    ran: list[str] = []
    live = await serve(agent(ran))
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "wipe disk"})
        body = r.json()
        assert body["status"] == "waiting" and body["reply"] is None
        (req,) = body["events"][-1]["data"]["requests"]
        info = (await c.get(f"/v1/sessions/{sid}")).json()
        assert info["status"] == "waiting" and info["pending"] == [req]
        r = await c.post(f"/v1/sessions/{sid}/responses", json={"request_id": req["request_id"], "decision": "approve"})
        assert r.status_code == 202
        assert r.json() == {"session_id": sid, "request_id": req["request_id"], "decision": "approve"}
        again = await c.post(
            f"/v1/sessions/{sid}/responses", json={"request_id": req["request_id"], "decision": "approve"}
        )
        assert again.status_code == 202  # the same answer twice is accepted (once)
        other = await c.post(
            f"/v1/sessions/{sid}/responses", json={"request_id": req["request_id"], "decision": "deny"}
        )
        assert other.status_code == 409
        assert other.json()["error"] | {"message": ""} == {
            "code": "already_answered",
            "message": "",
            "decision": "approve",
        }
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "after"})
        assert r.json()["reply"] == "re:after"
        assert ran == ["disk"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b'{"request_id": "req_nope", "decision": "approve"}', 404, "request_not_found"),
        (b'{"request_id": "{rid}", "decision": "maybe"}', 400, "invalid_decision"),
        (b'{"request_id": "{rid}"}', 400, "invalid_request"),
        (b'{"request_id": "{rid}", "decision": "approve", "extra": 1}', 400, "invalid_request"),
        (b'{"request_id": "{rid}", "decision": "approve", "reason": "' + b"r" * 2001 + b'"}', 400, "invalid_request"),
        (b'{"request_id": 5, "decision": "approve"}', 400, "invalid_request"),
        (b"nope", 400, "invalid_json"),
    ],
)
async def test_bad_answers_get_4xx_and_change_nothing(
    serve: Any, redis: Redis, body: bytes, status: int, code: str
) -> None:
    ran: list[str] = []
    live = await serve(agent(ran), run_turns=True)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        turn = (await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "wipe x"})).json()
        rid = turn["events"][-1]["data"]["requests"][0]["request_id"]
        await jobs_done(redis)
        before = await snapshot(redis)
        r = await c.post(f"/v1/sessions/{sid}/responses", content=body.replace(b"{rid}", rid.encode()))
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code
        assert await snapshot(redis) == before
        assert ran == []


async def test_a_request_is_answerable_only_in_its_own_session_by_its_owner(serve: Any) -> None:
    live = await serve(agent([]), api_keys=("alice", "bob"))
    async with live.client("alice") as alice, live.client("bob") as bob:
        sid = (await alice.post("/v1/sessions")).json()["session_id"]
        other = (await alice.post("/v1/sessions")).json()["session_id"]
        turn = (await alice.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "wipe y"})).json()
        rid = turn["events"][-1]["data"]["requests"][0]["request_id"]
        answer = {"request_id": rid, "decision": "approve"}
        r = await alice.post(f"/v1/sessions/{other}/responses", json=answer)
        assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
        r = await bob.post(f"/v1/sessions/{sid}/responses", json=answer)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        r = await bob.post(f"/v1/sessions/{sid}/cancel")
        assert r.status_code == 404
        assert (await alice.get(f"/v1/sessions/{sid}")).json()["pending"][0]["request_id"] == rid


async def test_cancel_over_http(serve: Any) -> None:
    live = await serve(agent([]))
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/cancel")
        assert r.status_code == 409 and r.json()["error"]["code"] == "nothing_to_cancel"
        turn = (await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "wipe z"})).json()
        r = await c.post(f"/v1/sessions/{sid}/cancel")
        assert r.status_code == 202 and r.json() == {"session_id": sid, "turn_id": turn["events"][0]["turn_id"]}
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "next"})
        assert r.json()["reply"] == "re:next"
        info = (await c.get(f"/v1/sessions/{sid}")).json()
        assert info["status"] == "idle" and info["pending"] == []


async def test_cancel_racing_an_answer_ends_the_turn_as_its_status_code_says(serve: Any, redis: Redis) -> None:
    """Issue 16's race, over HTTP, many times: an answer and a cancel sent together. A 202 cancel
    ends its turn cancelled and a 409 one finds it completed; a tool.started is always followed
    by its tool.completed (an event never says a call began that never ran)."""
    import asyncio
    import json

    from harness.store import Store

    ran: list[str] = []
    live = await serve(agent(ran), run_turns=True)
    store = Store(redis)

    async def race(c: Any, n: int) -> tuple[int, list[str], list[dict[str, Any]]]:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        waited = (await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": f"wipe t{n}"})).json()
        (req,) = waited["events"][-1]["data"]["requests"]
        answer = {"request_id": req["request_id"], "decision": "approve" if n % 4 < 2 else "deny"}
        cancel = {"turn_id": waited["events"][-1]["turn_id"]} if n % 2 else {}
        answered, cancelled = await asyncio.gather(
            c.post(f"/v1/sessions/{sid}/responses", json=answer), c.post(f"/v1/sessions/{sid}/cancel", json=cancel)
        )
        assert answered.status_code in (202, 409) and cancelled.status_code in (202, 409), cancelled.text
        await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "after"})  # queued behind it
        events = [json.loads(e.raw) for e in await store.outbox.events(sid, "0-0")]
        return cancelled.status_code, [e["type"] for e in events], events

    try:
        async with live.client() as c:
            outcomes = await asyncio.gather(*(race(c, n) for n in range(40)))
    finally:
        await store.close()
    for status, types, events in outcomes:
        first_end = next(t for t in types if t in ("turn.completed", "turn.cancelled"))
        assert first_end == ("turn.cancelled" if status == 202 else "turn.completed"), (status, types)
        started = {e["data"]["call_id"] for e in events if e["type"] == "tool.started"}
        completed = {e["data"]["call_id"] for e in events if e["type"] == "tool.completed"}
        assert started <= completed, types

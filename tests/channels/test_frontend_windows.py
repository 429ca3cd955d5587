"""The frontend routes and the memory windows: a turn that waits for approval longer than
KEEL_EVENT_RETENTION_HOURS (its events gone from the outbox) or KEEL_IDEMPOTENCY_HOURS stays
answerable, resumable, and is not run twice. The windows here are a fraction of a second; each
wait is on the window having passed in Redis."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from harness import Agent, ToolContext, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from harness.store.keys import SessionKeys
from tests.channels.slack_support import eventually
from tests.channels.test_frontends import answered, approval_of, chunks_of, user
from tests.frontend_agent import PacedModel, frontend_agent, text_of
from tests.harness.test_memory import window_passed


async def outbox_gone(redis: Redis, sid: str) -> None:
    """Until the session's events have all left the outbox (its window passed)."""

    async def gone() -> bool:
        return not await redis.exists(SessionKeys(sid).outbox)

    await eventually(gone, 5)


async def paused_then_outbox_gone(serve: Any, redis: Redis) -> tuple[Any, str, dict[str, Any], list[Any], Any]:
    """A useChat turn that asked to pay 30 and waits, its events since gone with the window."""
    agent, runs, _ = frontend_agent()
    live = await serve(agent, event_retention_ms=300, idempotency_ms=300)
    c = live.client()
    sid = (await c.post("/v1/sessions")).json()["session_id"]
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 30", "m1")]})
    (asked,) = approval_of(first)

    await outbox_gone(redis, sid)
    info = (await c.get(f"/v1/sessions/{sid}")).json()
    assert info["status"] == "waiting" and [p["request_id"] for p in info["pending"]] == [asked["approvalId"]]
    return c, sid, asked, first, runs


async def test_a_usechat_answer_after_the_event_window_runs_the_call(serve: Any, redis: Redis) -> None:
    c, sid, asked, first, runs = await paused_then_outbox_gone(serve, redis)
    body = {"id": sid, "messages": [user("pay 30", "m1"), answered(first[0]["messageId"], [asked], [True])]}
    rest = await asyncio.wait_for(chunks_of(c, "POST", "/v1/chat", body), 10)
    out = next(g for g in rest[:-1] if g["type"] == "tool-output-available")
    assert out == {"type": "tool-output-available", "toolCallId": asked["toolCallId"], "output": "paid 30"}
    assert rest[-2] == {"type": "finish", "finishReason": "stop"} and rest[-1] == "[DONE]"
    assert list(runs.values()) == [1]
    await c.aclose()


async def test_an_ag_ui_resume_after_the_event_window_runs_the_call(serve: Any, redis: Redis) -> None:
    c, sid, asked, _, runs = await paused_then_outbox_gone(serve, redis)
    run = {
        "threadId": sid,
        "runId": "r",
        "resume": [{"interruptId": asked["approvalId"], "status": "resolved", "payload": {"approved": True}}],
    }
    got = await asyncio.wait_for(chunks_of(c, "POST", "/v1/agui", run), 10)
    assert next(e for e in got if e["type"] == "TOOL_CALL_RESULT")["content"] == "paid 30"
    assert got[-1]["type"] == "RUN_FINISHED" and got[-1]["outcome"] == {"type": "success"}
    assert list(runs.values()) == [1]
    await c.aclose()


async def paused_past_the_id_window(serve: Any, redis: Redis) -> tuple[Any, str, dict[str, Any], Any]:
    agent, runs, _ = frontend_agent()
    live = await serve(agent, idempotency_ms=300)
    c = live.client()
    sid = (await c.post("/v1/sessions")).json()["session_id"]
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 30", "m1")]})
    (asked,) = approval_of(first)
    await window_passed(redis, 300)
    assert (await c.get(f"/v1/sessions/{sid}")).json()["status"] == "waiting"
    return c, sid, asked, runs


async def test_a_usechat_resume_of_a_turn_waiting_past_the_id_window_replays_it(serve: Any, redis: Redis) -> None:
    c, sid, asked, _ = await paused_past_the_id_window(serve, redis)
    again = await asyncio.wait_for(chunks_of(c, "GET", f"/v1/chat/{sid}/stream"), 10)
    assert [a["approvalId"] for a in approval_of(again)] == [asked["approvalId"]]
    await c.aclose()


async def test_a_usechat_resend_of_the_waiting_message_past_the_id_window_is_not_a_second_turn(
    serve: Any, redis: Redis
) -> None:
    """useChat sends the conversation again (a reload): the message whose turn waits is the same
    message however long it waited, so its turn replays up to its request; nothing is queued."""
    c, sid, asked, runs = await paused_past_the_id_window(serve, redis)
    again = await asyncio.wait_for(
        chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 30", "m1")]}), 10
    )
    assert [a["approvalId"] for a in approval_of(again)] == [asked["approvalId"]]
    info = (await c.get(f"/v1/sessions/{sid}")).json()
    assert info["queued"] == 0 and info["status"] == "waiting" and not runs
    await c.aclose()


async def asked_two(serve: Any) -> tuple[Any, str, list[Any], list[dict[str, Any]], Any]:
    """A useChat turn that asked to pay 1 and 2 together and waits (windows of 300 ms)."""
    agent, runs, _ = frontend_agent()
    live = await serve(agent, event_retention_ms=300, idempotency_ms=300)
    c = live.client()
    sid = (await c.post("/v1/sessions")).json()["session_id"]
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 1 2", "m1")]})
    return c, sid, first, approval_of(first), runs


async def test_a_repeated_usechat_answer_after_the_event_window_is_refused_not_left_hanging(
    serve: Any, redis: Redis
) -> None:
    """Two requests, one answered; the turn waits on the other. Once the events are gone, the
    same answer again has nothing to stream after it that the client could be told apart from
    what it has: 404, at once (not a stream that waits for an event that never comes)."""
    c, sid, first, asked, runs = await asked_two(serve)
    answer = {"id": sid, "messages": [answered(first[0]["messageId"], asked[:1], [True])]}
    rest = await asyncio.wait_for(chunks_of(c, "POST", "/v1/chat", answer), 10)
    assert rest[-2] == {"type": "finish", "finishReason": "tool-calls"}  # (waiting on the other)

    await outbox_gone(redis, sid)
    again = await asyncio.wait_for(c.post("/v1/chat", json=answer), 10)
    assert again.status_code == 404 and again.json()["error"]["code"] == "request_not_found", again.text
    assert (await c.get(f"/v1/sessions/{sid}")).json()["status"] == "waiting" and not runs
    await c.aclose()


async def test_a_different_usechat_answer_after_the_event_window_is_409_already_answered(
    serve: Any, redis: Redis
) -> None:
    c, sid, first, asked, _ = await asked_two(serve)
    yes = {"id": sid, "messages": [answered(first[0]["messageId"], asked[:1], [True])]}
    await asyncio.wait_for(chunks_of(c, "POST", "/v1/chat", yes), 10)

    await outbox_gone(redis, sid)
    no = {"id": sid, "messages": [answered(first[0]["messageId"], asked[:1], [False])]}
    r = await c.post("/v1/chat", json=no)
    assert r.status_code == 409 and r.json()["error"]["code"] == "already_answered", r.text
    await c.aclose()


async def test_a_repeated_usechat_answer_streams_while_its_answers_event_is_kept(serve: Any, redis: Redis) -> None:
    """The request asked longer ago than events are kept, answered just now: the same answer
    again streams the rest of the turn from that answer's input.resolved, as within the window."""
    gate = asyncio.Event()

    @tool(approval=True)
    async def pay(amount: int, ctx: ToolContext) -> str:
        """Pay."""
        await gate.wait()
        return f"paid {amount}"

    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "tool":
            return ModelReply(text="Done")
        return ModelReply(text="I will pay.", tool_calls=[ToolCall("pay", {"amount": 3})])

    agent = Agent(instructions="t", tools=[pay], model=ScriptedModel(script))
    live = await serve(agent, event_retention_ms=300, idempotency_ms=300)
    c = live.client()
    sid = (await c.post("/v1/sessions")).json()["session_id"]
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay", "m1")]})
    asked = approval_of(first)

    await outbox_gone(redis, sid)
    body = {"id": sid, "messages": [answered(first[0]["messageId"], asked, [True])]}
    streams = [asyncio.create_task(chunks_of(c, "POST", "/v1/chat", body))]

    async def running() -> bool:
        return bool((await c.get(f"/v1/sessions/{sid}")).json()["status"] == "running")

    await eventually(running, 5)  # (the tool runs, held at the gate)
    began = asyncio.Event()
    streams.append(asyncio.create_task(chunks_of(c, "POST", "/v1/chat", body, began)))  # the same answer again
    await asyncio.wait_for(began.wait(), 10)  # (accepted, and streaming, while the turn runs)
    gate.set()
    for got in await asyncio.wait_for(asyncio.gather(*streams), 10):
        out = next(g for g in got[:-1] if g["type"] == "tool-output-available")
        assert out["output"] == "paid 3" and got[-2] == {"type": "finish", "finishReason": "stop"}
    await c.aclose()


# ---- a turn that waits longer than events are kept: its requests close the stream -----------


async def test_a_usechat_resume_of_a_turn_waiting_past_the_event_window_shows_its_request(
    serve: Any, redis: Redis
) -> None:
    """The input.requested left the outbox with everything before it: the stream is made of the
    requests the turn still waits on, and closes as it did when they were asked."""
    c, sid, asked, _, runs = await paused_then_outbox_gone(serve, redis)
    again = await asyncio.wait_for(chunks_of(c, "GET", f"/v1/chat/{sid}/stream"), 10)
    (shown,) = approval_of(again)
    assert shown["approvalId"] == asked["approvalId"] and shown["toolCallId"] == asked["toolCallId"]
    call = next(g for g in again if g["type"] == "tool-input-available")
    assert call["toolName"] == "pay" and call["input"] == {"amount": 30}
    assert again[-2] == {"type": "finish", "finishReason": "tool-calls"} and again[-1] == "[DONE]"
    assert not runs
    await c.aclose()


async def test_a_usechat_resend_of_a_message_waiting_past_the_event_window_shows_its_request(
    serve: Any, redis: Redis
) -> None:
    c, sid, asked, _, runs = await paused_then_outbox_gone(serve, redis)
    body = {"id": sid, "messages": [user("pay 30", "m1")]}
    again = await asyncio.wait_for(chunks_of(c, "POST", "/v1/chat", body), 10)
    assert [a["approvalId"] for a in approval_of(again)] == [asked["approvalId"]]
    assert again[-2] == {"type": "finish", "finishReason": "tool-calls"}
    info = (await c.get(f"/v1/sessions/{sid}")).json()
    assert info["queued"] == 0 and info["status"] == "waiting" and not runs
    await c.aclose()


async def test_answering_one_of_two_requests_past_the_event_window_streams_the_other(serve: Any, redis: Redis) -> None:
    """Both asked longer ago than events are kept; one answered now: the stream ends as it does
    within the window, waiting on the other (shown with it when they were asked, not again),
    and answering that one runs both calls."""
    c, sid, first, asked, runs = await asked_two(serve)
    await outbox_gone(redis, sid)

    one = {"id": sid, "messages": [answered(first[0]["messageId"], asked[:1], [True])]}
    rest = await asyncio.wait_for(chunks_of(c, "POST", "/v1/chat", one), 10)
    assert approval_of(rest) == [] and rest[-2] == {"type": "finish", "finishReason": "tool-calls"}
    both = {"id": sid, "messages": [answered(first[0]["messageId"], asked, [True, True])]}
    done = await asyncio.wait_for(chunks_of(c, "POST", "/v1/chat", both), 10)
    outputs = sorted(g["output"] for g in done[:-1] if g["type"] == "tool-output-available")
    assert outputs == ["paid 1", "paid 2"] and done[-2] == {"type": "finish", "finishReason": "stop"}
    assert sorted(runs.values()) == [1, 1]
    await c.aclose()


async def test_an_ag_ui_rerun_of_a_turn_waiting_past_the_event_window_is_interrupted_again(
    serve: Any, redis: Redis
) -> None:
    c, sid, asked, _, runs = await paused_then_outbox_gone(serve, redis)
    run = {"threadId": sid, "runId": "r2", "messages": [{"id": "m1", "role": "user", "content": "pay 30"}]}
    got = await asyncio.wait_for(chunks_of(c, "POST", "/v1/agui", run), 10)
    outcome = got[-1]["outcome"]
    assert got[-1]["type"] == "RUN_FINISHED" and outcome["type"] == "interrupt"
    assert [i["id"] for i in outcome["interrupts"]] == [asked["approvalId"]]
    assert not runs
    await c.aclose()


# ---- the catch-up's races: a stream shows what it shows without one -------------------------


def agent_of(gate: asyncio.Event, began: asyncio.Event) -> Agent:
    """'pay 1' asks to pay 1 (after `gate`); once paid, it asks to pay 2; then it is done."""

    @tool(approval=True)
    def pay(amount: int, ctx: ToolContext) -> str:
        """Pay an amount."""
        return f"paid {amount}"

    async def script(r: ModelRequest) -> ModelReply:
        paid = [m.text for m in r.messages if m.role == "tool" and m.turn_id == r.turn_id]
        if not paid:
            began.set()
            await gate.wait()
            return ModelReply(text="I will pay.", tool_calls=[ToolCall("pay", {"amount": 1})])
        if len(paid) == 1:
            return ModelReply(text="Now the rest.", tool_calls=[ToolCall("pay", {"amount": 2})])
        return ModelReply(text="Done.")

    return Agent(instructions="t", tools=[pay], model=PacedModel(script, chunk=4))


async def asked_to_pay(serve: Any) -> tuple[Any, Any, str, list[Any], dict[str, Any]]:
    """A useChat turn of `agent_of` that asked to pay 1 and waits."""
    gate, began = asyncio.Event(), asyncio.Event()
    gate.set()
    live = await serve(agent_of(gate, began))
    c = live.client()
    sid = (await c.post("/v1/sessions")).json()["session_id"]
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 1", "m1")]})
    (asked,) = approval_of(first)
    return live, c, sid, first, asked


def waits_on(redis: Redis, sid: str, not_this: str = "") -> Any:
    """Whether the session waits on a request (other than `not_this`)."""

    async def check() -> bool:
        raw = await redis.hget(SessionKeys(sid).meta, "waiting_on")
        return bool(raw) and raw.decode() != not_this

    return check


def newest_then(sessions: Any, meanwhile: Any) -> None:
    """`newest_event` as it is, with `meanwhile` happening right after it is read."""
    real = sessions.newest_event

    async def newest_event(sid: str) -> str:
        upto = await real(sid)
        await meanwhile()
        return upto

    sessions.newest_event = newest_event


async def test_a_resume_that_begins_as_the_turn_asks_shows_the_steps_text(serve: Any, redis: Redis) -> None:
    """The step (its text and its approval request) commits after the stream read where the
    outbox stood and before its replay got there: the stream shows the step as committed,
    not a request rebuilt in place of it."""
    gate, began = asyncio.Event(), asyncio.Event()
    live = await serve(agent_of(gate, began))
    c = live.client()
    sid = (await c.post("/v1/sessions")).json()["session_id"]
    posting = asyncio.create_task(chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 1", "m1")]}))
    await began.wait()

    async def step_commits() -> None:
        gate.set()
        await eventually(waits_on(redis, sid), 5)

    newest_then(live.app.state.harness.sessions, step_commits)
    again = await asyncio.wait_for(chunks_of(c, "GET", f"/v1/chat/{sid}/stream"), 10)
    first = await posting
    assert text_of(first[:-1]) == "I will pay."
    assert len(approval_of(again)) == 1
    assert text_of(again[:-1]) == "I will pay."
    await c.aclose()


async def test_an_answer_whose_turn_asks_again_quickly_shows_the_new_request(serve: Any, redis: Redis) -> None:
    """The answer's turn runs the paid call and asks again before the answer's stream has
    read where the outbox stood: the stream shows the call's result and the new request."""
    live, c, sid, first, asked = await asked_to_pay(serve)

    async def runs_and_asks_again() -> None:
        await eventually(waits_on(redis, sid, not_this=asked["approvalId"]), 5)

    newest_then(live.app.state.harness.sessions, runs_and_asks_again)
    body = {"id": sid, "messages": [user("pay 1", "m1"), answered(first[0]["messageId"], [asked], [True])]}
    rest = await asyncio.wait_for(chunks_of(c, "POST", "/v1/chat", body), 10)
    assert rest[-2] == {"type": "finish", "finishReason": "tool-calls"}
    outputs = [g["output"] for g in rest[:-1] if g["type"] == "tool-output-available"]
    assert outputs == ["paid 1"]
    assert len(approval_of(rest)) == 1  # (the new request, to pay 2)
    await c.aclose()


async def test_a_resume_whose_outbox_expires_as_it_begins_still_closes(serve: Any, redis: Redis) -> None:
    """The waiting session's outbox expires (the whole key) right after the stream read where
    it stood: the replay never gets there, and the stream still closes on the request."""
    live, c, sid, _, asked = await asked_to_pay(serve)

    async def outbox_expires() -> None:
        await redis.delete(SessionKeys(sid).outbox)

    newest_then(live.app.state.harness.sessions, outbox_expires)
    again = await asyncio.wait_for(chunks_of(c, "GET", f"/v1/chat/{sid}/stream"), 5)
    assert [a["approvalId"] for a in approval_of(again)] == [asked["approvalId"]]
    await c.aclose()


async def test_a_repeated_usechat_answer_of_an_ended_turn_streams_past_its_trimmed_start(
    serve: Any, redis: Redis
) -> None:
    """The turn asked, was answered and ended; its events up to the answer's have since left
    the outbox (trimmed as retention trims it). The same answer again, from a client that did
    not get the first stream, streams the rest of the turn from the answer on, as within the
    window (it was 404: the turn was looked for by its first event)."""
    agent, runs, _ = frontend_agent()
    live = await serve(agent)
    c = live.client()
    sid = (await c.post("/v1/sessions")).json()["session_id"]
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 30", "m1")]})
    (asked,) = approval_of(first)
    body = {"id": sid, "messages": [user("pay 30", "m1"), answered(first[0]["messageId"], [asked], [True])]}
    done = await asyncio.wait_for(chunks_of(c, "POST", "/v1/chat", body), 10)
    assert done[-2] == {"type": "finish", "finishReason": "stop"}

    outbox = SessionKeys(sid).outbox
    resolved = next(eid for eid, f in await redis.xrange(outbox) if f[b"t"] == b"input.resolved")
    await redis.xtrim(outbox, minid=resolved, approximate=False)  # (as the event window does)
    again = await asyncio.wait_for(chunks_of(c, "POST", "/v1/chat", body), 10)
    out = next(g for g in again[:-1] if g["type"] == "tool-output-available")
    assert out == {"type": "tool-output-available", "toolCallId": asked["toolCallId"], "output": "paid 30"}
    assert again[-2] == {"type": "finish", "finishReason": "stop"} and list(runs.values()) == [1]
    await c.aclose()

"""Human approval: gated calls pause the turn as committed requests; answers resume it and run
exactly the stored calls; denials, repeats, conflicts, queueing behind a paused turn, cancel."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from harness import Agent, Harness, ToolContext, tool
from harness.errors import Conflict, InvalidInput, NotFound
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from harness.store import AlreadyAnswered, Cancelling, Recorded
from tests.events import env


class Stalling:
    """A model that, for the message `trigger`, stops until `release` is set and then calls
    `tool`; it answers anything else with "ok". `thinking` is set while it is stopped."""

    def __init__(self, trigger: str, tool: str) -> None:
        self.trigger, self.tool = trigger, tool
        self.thinking, self.release = asyncio.Event(), asyncio.Event()

    async def __call__(self, r: ModelRequest) -> ModelReply:
        if r.messages[-1].text != self.trigger:
            return ModelReply(text="ok")
        self.thinking.set()
        await self.release.wait()
        return ModelReply(tool_calls=[ToolCall(self.tool)])


async def cancel_unheard(h: Harness, sid: str) -> None:
    """A cancel whose notice does not reach the running model call (notices are best-effort):
    the turn learns of it at its next commit, which is what these tests are about."""
    assert isinstance(await h.store.cancel(sid, "anon"), Cancelling)
    await h.store.add_job(sid)


def gated_agent(runs: list[tuple[str, dict[str, Any], str]]) -> tuple[Agent, ScriptedModel]:
    @tool(approval=True)
    def delete(path: str, ctx: ToolContext) -> str:
        """Delete a file."""
        runs.append(("delete", {"path": path}, ctx.call_id))
        return f"deleted {path}"

    @tool(approval=lambda name, args: args["amount"] > 100)
    def pay(amount: int, ctx: ToolContext) -> str:
        """Pay."""
        runs.append(("pay", {"amount": amount}, ctx.call_id))
        return f"paid {amount}"

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "user" and last.text.startswith("delete"):
            return ModelReply(text="asking", tool_calls=[ToolCall("delete", {"path": last.text.split()[1]})])
        if last.role == "user" and last.text == "pay both":
            return ModelReply(tool_calls=[ToolCall("pay", {"amount": 5}), ToolCall("pay", {"amount": 500})])
        if last.role == "user" and last.text == "two deletes":
            return ModelReply(tool_calls=[ToolCall("delete", {"path": "/a"}), ToolCall("delete", {"path": "/b"})])
        if last.role == "tool":
            return ModelReply(
                text=" | ".join(m.text for m in r.messages if m.role == "tool" and m.turn_id == r.turn_id)
            )
        return ModelReply(text=f"re:{last.text}")

    model = ScriptedModel(script)
    return Agent(instructions="t", tools=[delete, pay], model=model), model


async def test_a_gated_call_waits_for_approval_then_runs_exactly_as_stored(make_harness: Any) -> None:
    runs: list[tuple[str, dict[str, Any], str]] = []
    agent, model = gated_agent(runs)
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "delete /tmp/x"), 10)
    assert turn.status == "waiting"
    requested = env(turn.events[-1])
    assert requested["type"] == "input.requested"
    (req,) = requested["data"]["requests"]
    assert req["tool"] == "delete" and req["arguments"] == {"path": "/tmp/x"}
    info = await h.sessions.info(sid, "anon")
    assert info.status == "waiting" and msgspec.to_builtins(info.pending) == [req]
    assert runs == []

    res = await h.sessions.respond(sid, "anon", req["request_id"], "approve")
    assert isinstance(res, Recorded)
    done = await h.sessions.wait_turn(
        await h.sessions.submit(sid, "anon", "after"), 10
    )  # queued behind, runs after the resume
    assert done.status == "completed"
    history = await h.sessions.history(sid, "anon")
    call = history[1].tool_calls[0]
    assert runs == [("delete", {"path": "/tmp/x"}, call.id)]
    assert req["request_id"] == f"req_{call.id}"
    assert [(i.role, i.text) for i in history] == [
        ("user", "delete /tmp/x"),
        ("assistant", "asking"),
        ("tool", "deleted /tmp/x"),
        ("assistant", "deleted /tmp/x"),
        ("user", "after"),
        ("assistant", "re:after"),
    ]
    assert len(model.requests) == 3  # the committed step was not asked again
    info = await h.sessions.info(sid, "anon")
    assert info.status == "idle" and info.pending == []
    events = [e.type for e in await h.store.outbox.events(sid, "0-0")]
    assert events.count("input.requested") == 1 and events.count("input.resolved") == 1


async def test_several_gated_calls_are_one_request_event_answered_separately(make_harness: Any) -> None:
    runs: list[tuple[str, dict[str, Any], str]] = []
    agent, _ = gated_agent(runs)
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "two deletes"), 10)
    a, b = env(turn.events[-1])["data"]["requests"]
    await h.sessions.respond(sid, "anon", a["request_id"], "deny", "not that one")
    info = await h.sessions.info(sid, "anon")
    assert info.status == "waiting" and msgspec.to_builtins(info.pending) == [b]  # still waiting for the second
    assert runs == []
    first = await h.sessions.submit(sid, "anon", "queued while waiting")
    assert (await h.sessions.info(sid, "anon")).queued == 1  # this one, behind the paused turn (not its own message)
    await h.sessions.respond(sid, "anon", b["request_id"], "approve")
    assert (await h.sessions.wait_turn(first, 10)).reply == "re:queued while waiting"
    assert [r[1] for r in runs] == [{"path": "/b"}]
    texts = [i.text for i in await h.sessions.history(sid, "anon") if i.role == "tool"]
    assert texts == ["error: a person denied this call: not that one", "deleted /b"]


async def test_only_the_calls_the_callable_gates_wait(make_harness: Any) -> None:
    runs: list[tuple[str, dict[str, Any], str]] = []
    agent, _ = gated_agent(runs)
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "pay both"), 10)
    (req,) = env(turn.events[-1])["data"]["requests"]
    assert req["arguments"] == {"amount": 500}
    assert runs == []  # the whole step waits, the ungated call too
    await h.sessions.respond(sid, "anon", req["request_id"], "approve")
    after = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "next"), 10)
    assert after.status == "completed"
    assert [r[1] for r in runs] == [{"amount": 5}, {"amount": 500}]


async def test_answers_are_recorded_once(make_harness: Any) -> None:
    runs: list[tuple[str, dict[str, Any], str]] = []
    agent, _ = gated_agent(runs)
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    other = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "delete /x"), 10)
    rid = env(turn.events[-1])["data"]["requests"][0]["request_id"]
    with pytest.raises(NotFound) as unknown:
        await h.sessions.respond(sid, "anon", "req_nope", "approve")
    assert unknown.value.code == "request_not_found"
    with pytest.raises(NotFound):
        await h.sessions.respond(other, "anon", rid, "approve")  # another session's request
    with pytest.raises(NotFound):
        await h.sessions.respond(sid, "someone-else", rid, "approve")
    with pytest.raises(InvalidInput):
        await h.sessions.respond(sid, "anon", rid, "maybe")
    assert isinstance(await h.sessions.respond(sid, "anon", rid, "approve"), Recorded)
    again = await h.sessions.respond(sid, "anon", rid, "approve")
    assert isinstance(again, AlreadyAnswered) and again.answer.decision == "approve"
    with pytest.raises(Conflict) as conflict:
        await h.sessions.respond(sid, "anon", rid, "deny")
    assert conflict.value.code == "already_answered" and conflict.value.details == {"decision": "approve"}
    await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "next"), 10)
    assert len(runs) == 1
    resolved = [e for e in await h.store.outbox.events(sid, "0-0") if e.type == "input.resolved"]
    assert len(resolved) == 1


async def test_cancel_withdraws_open_requests_and_closes_every_call(make_harness: Any) -> None:
    runs: list[tuple[str, dict[str, Any], str]] = []
    agent, model = gated_agent(runs)
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "two deletes"), 10)
    a, b = env(turn.events[-1])["data"]["requests"]
    await h.sessions.respond(sid, "anon", a["request_id"], "approve")
    queued = await h.sessions.submit(sid, "anon", "then this")
    assert await h.sessions.cancel(sid, "anon") == env(turn.events[0])["turn_id"]
    assert (await h.sessions.wait_turn(queued, 10)).reply == "re:then this"
    assert runs == []
    events = await h.store.outbox.events(sid, "0-0")
    tail = [(e.type, e.raw) for e in events if e.type in ("input.resolved", "turn.cancelled")]
    assert [t for t, _ in tail] == ["input.resolved", "input.resolved", "turn.cancelled"]
    assert b'"decision":"withdrawn"' in tail[1][1] and b["request_id"].encode() in tail[1][1]
    tools = [i for i in await h.sessions.history(sid, "anon") if i.role == "tool"]
    assert [i.text for i in tools] == ["error: the turn was cancelled; not run"] * 2  # pairs stay whole
    with pytest.raises(Conflict) as late:
        await h.sessions.respond(sid, "anon", b["request_id"], "approve")
    assert late.value.details == {"decision": "withdrawn"}
    with pytest.raises(Conflict) as idle:
        await h.sessions.cancel(sid, "anon")
    assert idle.value.code == "nothing_to_cancel"
    assert len(model.requests) == 2


async def test_cancel_while_the_model_thinks_ends_the_turn_without_running_its_tools(make_harness: Any) -> None:
    ran: list[str] = []

    @tool
    def act() -> str:
        """Acts."""
        ran.append("act")
        return "acted"

    stall = Stalling("slow", "act")
    thinking, release = stall.thinking, stall.release
    model = ScriptedModel(stall)
    h = await make_harness(Agent(instructions="t", tools=[act], model=model))
    sid = await h.sessions.create("anon")
    slow = await h.sessions.submit(sid, "anon", "slow")
    await asyncio.wait_for(thinking.wait(), 5)
    await h.sessions.cancel(sid, "anon")
    release.set()
    turn = await h.sessions.wait_turn(slow, 10)
    assert turn.status == "cancelled"
    assert ran == []
    history = await h.sessions.history(sid, "anon")
    # the model call is interrupted (issue 12): its reply, tool call included, is never stored
    assert [(i.role, i.text) for i in history] == [("user", "slow")]
    info = await h.sessions.info(sid, "anon")
    assert info.status == "idle" and info.usage["model_calls"] == 1  # the cancelled attempt is accounted
    assert (await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "next"), 10)).status == "completed"


async def test_cancel_during_a_step_that_asks_for_approval_never_asks(make_harness: Any) -> None:
    ran: list[str] = []

    @tool(approval=True)
    def launch() -> str:
        """Launch."""
        ran.append("launch")
        return "launched"

    stall = Stalling("go", "launch")
    thinking, release = stall.thinking, stall.release
    h = await make_harness(Agent(instructions="t", tools=[launch], model=ScriptedModel(stall)))
    sid = await h.sessions.create("anon")
    await h.sessions.submit(sid, "anon", "go")
    await asyncio.wait_for(thinking.wait(), 5)
    await cancel_unheard(h, sid)  # the step would commit its requests with the cancel pending
    after = await h.sessions.submit(sid, "anon", "after")  # runs once the cancelled turn has ended
    release.set()
    assert (await h.sessions.wait_turn(after, 10)).status == "completed"
    types = [e.type for e in await h.store.outbox.events(sid, "0-0")]
    assert types.count("turn.cancelled") == 1
    assert "input.requested" not in types and "input.resolved" not in types  # nobody is asked in vain
    assert ran == [] and (await h.sessions.info(sid, "anon")).pending == []
    history = await h.sessions.history(sid, "anon")
    assert [(i.role, i.text) for i in history] == [("user", "go"), ("user", "after"), ("assistant", "ok")]


async def test_provider_call_ids_that_repeat_do_not_collide(make_harness: Any) -> None:
    """Providers that number calls per response (call_0 every time) must not make a later call
    look answered or done: keel mints its own call ids."""
    ran: list[int] = []

    @tool(approval=True)
    def pay(amount: int) -> str:
        """Pay."""
        ran.append(amount)
        return f"paid {amount}"

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "user" and last.text.isdigit():
            return ModelReply(tool_calls=[ToolCall("pay", {"amount": int(last.text)}, id="call_0")] * 2)
        return ModelReply(text="ok")

    h = await make_harness(Agent(instructions="t", tools=[pay], model=ScriptedModel(script)))
    sid = await h.sessions.create("anon")
    for amount in (5, 5000):
        turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", str(amount)), 10)
        requests = env(turn.events[-1])["data"]["requests"]
        assert len({r["request_id"] for r in requests}) == 2
        for r in requests:
            await h.sessions.respond(sid, "anon", r["request_id"], "approve")
        assert (await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "-"), 10)).status == "completed"
    assert ran == [5, 5, 5000, 5000]


async def test_an_answer_and_a_cancel_racing_never_overwrite_each_other(make_harness: Any) -> None:
    runs: list[tuple[str, dict[str, Any], str]] = []
    agent, _ = gated_agent(runs)
    h = await make_harness(agent, run_turns=False)  # nobody finishes the cancel: the race window stays open
    sid = await h.sessions.create("anon")
    await h.sessions.submit(sid, "anon", "delete /x")
    from harness.loop.turn import Turn

    begun = await h.store.begin(sid, "", 5_000)
    await Turn(h.store, agent, sid, begun).run()  # pauses with one request
    rid = (await h.sessions.info(sid, "anon")).pending[0].request_id
    turn_id = await h.sessions.cancel(sid, "anon")
    with pytest.raises(Conflict) as refused:  # the cancel is on its way: the request takes no answer
        await h.sessions.respond(sid, "anon", rid, "approve")
    assert refused.value.details == {"decision": "withdrawn"}
    with pytest.raises(Conflict):  # a cancel for a turn that is not the current one does nothing
        await h.sessions.cancel(sid, "anon", "turn_someotherturn")
    assert await h.sessions.cancel(sid, "anon", turn_id) == turn_id  # repeating the same cancel is fine
    begun = await h.store.begin(sid, "", 5_000)
    await Turn(h.store, agent, sid, begun).run()
    resolved = [e.raw for e in await h.store.outbox.events(sid, "0-0") if e.type == "input.resolved"]
    assert len(resolved) == 1 and b'"withdrawn"' in resolved[0]
    assert runs == []


async def test_asking_again_about_a_turn_that_paused_reports_how_it_ended(make_harness: Any) -> None:
    runs: list[tuple[str, dict[str, Any], str]] = []
    agent, _ = gated_agent(runs)
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    first = await h.sessions.submit_and_wait(sid, "anon", "delete /y", context=None, message_id="m1", timeout=10)
    assert first.status == "waiting"
    await h.sessions.respond(sid, "anon", env(first.events[-1])["data"]["requests"][0]["request_id"], "approve")
    await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "after"), 10)
    again = await h.sessions.submit_and_wait(sid, "anon", "delete /y", context=None, message_id="m1", timeout=10)
    assert again.status == "completed" and again.reply == "deleted /y"


async def test_a_crash_between_a_cancelled_pause_and_its_cancellation_still_withdraws(
    make_harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness.loop.turn import Turn

    real_cancel = Turn.cancel
    crashes = []

    async def dying_cancel(self: Turn) -> Any:
        if not crashes:  # the first runner "dies" here: after the cancel is taken, before its commit
            crashes.append(1)
            raise RuntimeError("process died")
        return await real_cancel(self)

    monkeypatch.setattr(Turn, "cancel", dying_cancel)
    agent, _ = gated_agent([])
    h = await make_harness(agent, lease_ms=500)
    sid = await h.sessions.create("anon")
    assert (await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "delete /z"), 10)).status == "waiting"
    await h.sessions.cancel(sid, "anon")
    after = await h.sessions.submit(sid, "anon", "after")
    assert (await h.sessions.wait_turn(after, 15)).status == "completed"  # the reclaimed job finished the cancel
    events = await h.store.outbox.events(sid, "0-0")
    rid = next(e for e in events if e.type == "input.requested").raw.split(b'"request_id":"')[1].split(b'"')[0]
    resolved = [e.raw for e in events if e.type == "input.resolved"]
    assert len(resolved) == 1 and rid in resolved[0] and b'"withdrawn"' in resolved[0]
    assert [e.type for e in events].count("turn.cancelled") == 1
    with pytest.raises(Conflict):
        await h.sessions.respond(sid, "anon", rid.decode(), "approve")
    assert crashes == [1]


# ---- a cancel racing the turn's next commit (issue 16: found by a hostile client) ------------


async def test_a_cancel_accepted_while_the_last_reply_is_on_its_way_ends_the_turn_cancelled(
    make_harness: Any,
) -> None:
    """The cancel lands after the model answered and before its final step commits (its notice
    does not reach the call): the accepted cancel wins; the reply is not stored or announced."""
    box: dict[str, Harness] = {}

    @tool
    def look() -> str:
        """Looks."""
        return "seen"

    async def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "user":
            return ModelReply(tool_calls=[ToolCall("look")])
        cancelled = await box["h"].store.cancel(r.session_id, "anon")
        assert isinstance(cancelled, Cancelling) and cancelled.turn_id == r.turn_id  # 202 for this turn
        return ModelReply(text="all done")

    h = box["h"] = await make_harness(Agent(instructions="t", tools=[look], model=ScriptedModel(script)))
    sid = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "go"), 10)
    assert turn.status == "cancelled"
    types = [e.type for e in await h.store.outbox.events(sid, "0-0")]
    assert "turn.completed" not in types and types.count("turn.cancelled") == 1
    assert types.count("message.completed") == 0
    history = await h.sessions.history(sid, "anon")
    assert [(i.role, i.text) for i in history] == [("user", "go"), ("assistant", ""), ("tool", "seen")]
    info = await h.sessions.info(sid, "anon")
    assert info.status == "idle" and info.usage["model_calls"] == 2  # the dropped reply's attempt counts


async def test_a_cancel_after_an_approval_never_announces_a_call_that_will_not_run(make_harness: Any) -> None:
    """The answer resumes the turn; the cancel lands after the resume began and before the
    approved call starts: no tool.started for a call that never runs."""
    from harness.loop.turn import Turn

    runs: list[tuple[str, dict[str, Any], str]] = []
    agent, _ = gated_agent(runs)
    h = await make_harness(agent, run_turns=False)  # the test runs the turn, to place the cancel exactly
    sid = await h.sessions.create("anon")
    await h.sessions.submit(sid, "anon", "delete /x")
    begun = await h.store.begin(sid, "", 5_000)
    await Turn(h.store, agent, sid, begun).run()  # pauses with one request
    rid = (await h.sessions.info(sid, "anon")).pending[0].request_id
    await h.sessions.respond(sid, "anon", rid, "approve")
    begun = await h.store.begin(sid, "", 5_000)  # the resume has begun...
    turn_id = await h.sessions.cancel(sid, "anon")  # ...when the cancel is accepted
    await Turn(h.store, agent, sid, begun).run()
    events = await h.store.outbox.events(sid, "0-0")
    types = [e.type for e in events]
    assert runs == [] and "tool.started" not in types
    assert types[-1] == "turn.cancelled" and events[-1].raw.count(turn_id.encode()) == 1
    history = await h.sessions.history(sid, "anon")
    assert history[-1].role == "tool" and history[-1].text == "error: the turn was cancelled; not run"


async def test_a_cancel_while_the_model_picks_a_tool_announces_no_call(make_harness: Any) -> None:
    """A step that calls an ungated tool commits with the cancel pending: neither its reply nor a
    tool.started is written; the turn ends cancelled with its user message alone."""
    ran: list[str] = []

    @tool
    def act() -> str:
        """Acts."""
        ran.append("act")
        return "acted"

    stall = Stalling("go", "act")
    h = await make_harness(Agent(instructions="t", tools=[act], model=ScriptedModel(stall)))
    sid = await h.sessions.create("anon")
    go = await h.sessions.submit(sid, "anon", "go")
    await asyncio.wait_for(stall.thinking.wait(), 5)
    await cancel_unheard(h, sid)
    stall.release.set()
    assert (await h.sessions.wait_turn(go, 10)).status == "cancelled"
    types = [e.type for e in await h.store.outbox.events(sid, "0-0")]
    assert ran == [] and "tool.started" not in types
    assert [(i.role, i.text) for i in await h.sessions.history(sid, "anon")] == [("user", "go")]


async def test_a_cancel_between_two_calls_announces_only_the_call_that_ran(make_harness: Any) -> None:
    """Two ungated calls in one step; the cancel lands while the first runs: the first has its
    tool.started and tool.completed, the second neither (it is closed as not run)."""
    box: dict[str, Harness] = {}

    @tool
    async def first(ctx: ToolContext) -> str:
        """First."""
        await box["h"].store.cancel(ctx.session_id, "anon")
        return "one"

    @tool
    def second() -> str:
        """Second."""
        return "two"

    def script(r: ModelRequest) -> ModelReply:
        return ModelReply(tool_calls=[ToolCall("first"), ToolCall("second")])

    h = box["h"] = await make_harness(Agent(instructions="t", tools=[first, second], model=ScriptedModel(script)))
    sid = await h.sessions.create("anon")
    assert (await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "go"), 10)).status == "cancelled"
    events = await h.store.outbox.events(sid, "0-0")
    started = [e.raw for e in events if e.type == "tool.started"]
    assert len(started) == 1 and b'"tool":"first"' in started[0]
    assert [e.type for e in events].count("tool.completed") == 1
    history = await h.sessions.history(sid, "anon")
    assert [i.text for i in history if i.role == "tool"] == ["one", "error: the turn was cancelled; not run"]

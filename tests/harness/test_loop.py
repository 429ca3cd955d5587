"""The agent loop: tools, bounds, failures, queueing, idempotency, fencing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harness import Agent, ToolContext, tool
from harness.errors import StaleLease
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from harness.store import Begun
from tests.events import env


def types_of(turn: Any) -> list[str]:
    return [e.type for e in turn.events]


async def test_tool_loop_runs_tools_and_commits_pairs_in_order(make_harness: Any) -> None:
    seen_ctx: list[ToolContext] = []

    @tool
    async def mul(a: int, b: int, ctx: ToolContext) -> int:
        """Multiply."""
        seen_ctx.append(ctx)
        return a * b

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "user":
            return ModelReply(text="working", tool_calls=[ToolCall("mul", {"a": 6, "b": 7}, id="c1")])
        return ModelReply(text=f"answer {last.text}")

    h = await make_harness(Agent(instructions="t", tools=[mul], model=ScriptedModel(script)))
    sid = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "6*7?"), 10)
    assert turn.status == "completed" and turn.reply == "answer 42"
    assert types_of(turn) == [
        "message.received",
        "turn.started",
        "usage.recorded",
        "message.completed",
        "tool.started",
        "tool.completed",
        "usage.recorded",
        "message.completed",
        "turn.completed",
    ]
    history = await h.sessions.history(sid, "anon")
    assert [(i.role, i.text) for i in history] == [
        ("user", "6*7?"),
        ("assistant", "working"),
        ("tool", "42"),
        ("assistant", "answer 42"),
    ]
    call_id = history[1].tool_calls[0].id
    assert call_id == history[2].tool_call_id and call_id != "c1"  # keel's own id, not the model's
    assert seen_ctx == [ToolContext(session_id=sid, turn_id=env(turn.events[0])["turn_id"], call_id=call_id)]
    seqs = [e.seq for e in turn.events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


async def test_bad_tool_calls_become_error_results_and_the_model_goes_on(make_harness: Any) -> None:
    @tool
    def need_int(n: int) -> int:
        """Needs an int."""
        return n

    @tool
    def boom() -> None:
        """Fails."""
        raise RuntimeError("kaput")

    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "user":
            return ModelReply(tool_calls=[ToolCall("need_int", {"n": "x"}), ToolCall("nope", {}), ToolCall("boom")])
        results = [m for m in r.messages if m.role == "tool"]
        return ModelReply(text=" | ".join(f"{m.is_error}:{m.text}" for m in results))

    h = await make_harness(Agent(instructions="t", tools=[need_int, boom], model=ScriptedModel(script)))
    sid = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "go"), 10)
    assert turn.status == "completed"
    parts = (turn.reply or "").split(" | ")
    assert parts[0].startswith("True:error: invalid arguments for need_int")
    assert parts[1] == "True:error: there is no tool named 'nope'"
    assert parts[2] == "True:error: RuntimeError: kaput"


async def test_max_steps_bounds_a_turn(make_harness: Any) -> None:
    @tool
    def again() -> str:
        """Loop."""
        return "more"

    model = ScriptedModel(lambda r: ModelReply(tool_calls=[ToolCall("again")]))
    h = await make_harness(Agent(instructions="t", tools=[again], model=model, max_steps=3))
    sid = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "go"), 10)
    assert turn.status == "failed"
    assert env(turn.events[-1])["data"]["error"]["code"] == "max_steps"
    assert len(model.requests) == 3
    assert (await h.sessions.info(sid, "anon")).status == "idle"


async def test_a_model_error_fails_the_turn_and_the_session_goes_on(make_harness: Any) -> None:
    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].text == "explode":
            raise ConnectionError("provider down")
        return ModelReply(text="fine")

    h = await make_harness(Agent(instructions="t", model=ScriptedModel(script)))
    sid = await h.sessions.create("anon")
    bad = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "explode"), 10)
    assert bad.status == "failed"
    assert (await h.sessions.info(sid, "anon")).usage["model_calls"] == 1  # the failed attempt may be billed: counted
    assert env(bad.events[-1])["data"]["error"] == {
        "code": "model_error",
        "message": "the model call failed: ConnectionError: provider down",
    }
    good = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "hello"), 10)
    assert good.status == "completed" and good.reply == "fine"


async def test_queued_messages_run_one_at_a_time_in_order(make_harness: Any) -> None:
    running = 0
    overlap = False

    async def script(r: ModelRequest) -> ModelReply:
        nonlocal running, overlap
        running += 1
        overlap |= running > 1
        await asyncio.sleep(0)  # yield so that a second turn could interleave if it were allowed to
        running -= 1
        return ModelReply(text=f"re:{r.messages[-1].text}")

    h = await make_harness(Agent(instructions="t", model=ScriptedModel(script)))
    sid = await h.sessions.create("anon")
    results = [await h.sessions.submit(sid, "anon", f"m{n}") for n in range(8)]
    turns = [await h.sessions.wait_turn(r, 10) for r in results]
    assert [t.reply for t in turns] == [f"re:m{n}" for n in range(8)]
    assert not overlap
    texts = [i.text for i in await h.sessions.history(sid, "anon")]
    assert texts == [x for n in range(8) for x in (f"m{n}", f"re:m{n}")]


async def test_a_repeated_message_id_is_one_message_and_one_turn(make_harness: Any) -> None:
    model = ScriptedModel(lambda r: ModelReply(text="once"))
    h = await make_harness(Agent(instructions="t", model=model))
    sid = await h.sessions.create("anon")
    first = await h.sessions.submit(sid, "anon", "hello", message_id="m-1")
    again = await h.sessions.submit(sid, "anon", "hello", message_id="m-1")
    assert not first.duplicate and again.duplicate
    assert (again.turn_id, again.received_id) == (first.turn_id, first.received_id)
    turn = await h.sessions.wait_turn(again, 10)
    assert turn.status == "completed"
    later = await h.sessions.submit(sid, "anon", "hello", message_id="m-1")  # after the turn: still the same one
    assert later.duplicate and (await h.sessions.wait_turn(later, 10)).events == turn.events
    assert len(model.requests) == 1
    assert [i.text for i in await h.sessions.history(sid, "anon")] == ["hello", "once"]
    received = [e async for e in _events(h, sid) if e.type == "message.received"]
    assert len(received) == 1


async def _events(h: Any, sid: str) -> Any:
    for e in await h.store.outbox.events(sid, "0-0"):
        yield e


async def test_a_commit_from_a_stale_lease_is_refused(make_harness: Any, redis: Any) -> None:
    h = await make_harness(
        Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="x"))), run_turns=False
    )
    sid = await h.sessions.create("anon")
    await h.sessions.submit(sid, "anon", "hi")
    old = await h.store.begin(sid, "", 5_000)
    assert isinstance(old, Begun)
    assert await redis.delete(f"keel:{{{sid}}}:lease") == 1  # the lease lapses, as when its runner stalls
    new = await h.store.begin(sid, "", 5_000)
    assert isinstance(new, Begun) and int(new.fence) > int(old.fence)
    assert new.message.turn_id == old.message.turn_id
    with pytest.raises(StaleLease):
        await h.store.commit(sid, old.fence, old.message.turn_id, [], [], mode="final")
    assert await h.store.queued(sid) == 1  # the stale final commit popped nothing
    await h.store.commit(sid, new.fence, new.message.turn_id, [], [], mode="final")
    assert await h.store.queued(sid) == 0


async def test_a_busy_session_is_not_begun_twice(make_harness: Any) -> None:
    h = await make_harness(
        Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="x"))), run_turns=False
    )
    sid = await h.sessions.create("anon")
    await h.sessions.submit(sid, "anon", "hi")
    first = await h.store.begin(sid, "", 5_000)
    second = await h.store.begin(sid, "", 5_000)
    assert isinstance(first, Begun)
    assert type(second).__name__ == "Busy"


async def test_a_slow_sync_tool_does_not_stop_other_sessions(make_harness: Any) -> None:
    import threading

    release = threading.Event()

    @tool
    def slow() -> str:
        """Blocks until released (a slow sync tool: a file, a subprocess, a blocking client)."""
        assert release.wait(10)
        return "slow done"

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "user" and last.text == "slow":
            return ModelReply(tool_calls=[ToolCall("slow")])
        return ModelReply(text=f"re:{last.text}")

    h = await make_harness(Agent(instructions="t", tools=[slow], model=ScriptedModel(script)))
    a, b = await h.sessions.create("anon"), await h.sessions.create("anon")
    blocked = await h.sessions.submit(a, "anon", "slow")
    # while session a's tool blocks, session b's turn completes: the event loop is free
    other = await h.sessions.wait_turn(await h.sessions.submit(b, "anon", "quick"), 5)
    assert other.status == "completed" and other.reply == "re:quick"
    release.set()
    assert (await h.sessions.wait_turn(blocked, 10)).reply == "re:slow done"


@pytest.mark.parametrize(
    "context",
    [{"page": True}, {"page": 3}, {"page": ["a"]}, ["a", 3], 5, {"": "v"}, {"k" * 65: "v"}],
)
async def test_the_python_api_refuses_malformed_context_and_writes_nothing(
    make_harness: Any, redis: Any, context: Any
) -> None:
    from harness.errors import InvalidInput

    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="ok")))
    h = await make_harness(agent, run_turns=False)  # no runner writing in the background
    sid = await h.sessions.create("anon")
    before = {k: await redis.dump(k) for k in await redis.keys("*")}
    with pytest.raises(InvalidInput):
        await h.sessions.submit(sid, "anon", "hi", context)
    assert {k: await redis.dump(k) for k in await redis.keys("*")} == before
    assert not (await h.sessions.submit(sid, "anon", "next", {"page": "ok"})).duplicate


async def test_a_redis_that_forgot_keels_scripts_records_each_step_once(make_harness: Any, redis: Any) -> None:
    model = ScriptedModel(lambda r: ModelReply(text="ok"))
    h = await make_harness(Agent(instructions="t", model=model))
    sid = await h.sessions.create("anon")
    await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "one"), 10)
    await redis.script_flush()  # as after a Redis restart without persistence of the script cache
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "two"), 10)
    assert turn.status == "completed"
    events = [e.type for e in await h.store.outbox.events(sid, "0-0")]
    assert events.count("usage.recorded") == 2 and events.count("turn.completed") == 2
    assert [i.text for i in await h.sessions.history(sid, "anon")] == ["one", "ok", "two", "ok"]
    assert (await h.sessions.info(sid, "anon")).usage["model_calls"] == 2

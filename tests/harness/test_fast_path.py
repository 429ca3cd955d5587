"""The fast path of a turn (SUBMIT begins it, usage written by the commit, events handed to local
readers) keeps the guarantees of the slow one: a begun turn always has a runner slot and a
renewed lease, a caller cancelled mid-submit strands nothing, a flushed script cache changes no
order, a reader waiting while this process only waits on another's lease still hears, a session
let go as its turn ends takes the next message at once, and a stop leaves no drain running."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from harness import Agent, Harness, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall, Usage


async def test_a_turn_begun_by_submit_waits_for_no_slot_with_an_unrenewed_lease(make_harness: Any) -> None:
    calls: dict[str, int] = {}
    a_running = asyncio.Event()

    async def script(r: ModelRequest) -> ModelReply:
        text = r.messages[-1].text
        calls[text] = calls.get(text, 0) + 1
        if text == "A":
            a_running.set()
            await asyncio.sleep(1.0)  # longer than the lease: only renewal keeps it
        return ModelReply(text="re " + text, usage=Usage(10, 1))

    h = await make_harness(Agent(instructions="t", model=ScriptedModel(script)), concurrency=1, lease_ms=300)
    a, b = await h.sessions.create("o"), await h.sessions.create("o")
    ra, rb = await asyncio.gather(h.sessions.submit(a, "o", "A"), h.sessions.submit(b, "o", "B"))
    done_a, done_b = await asyncio.gather(h.sessions.wait_turn(ra, 20), h.sessions.wait_turn(rb, 20))
    assert (done_a.status, done_b.status) == ("completed", "completed")
    assert calls == {"A": 1, "B": 1}  # no model call repeated after a lapsed lease
    info = await h.sessions.info(b, "o")
    assert info.usage["model_calls"] == 1 and info.usage["input_tokens"] == 10


async def test_a_caller_cancelled_mid_submit_strands_no_lease(make_harness: Any, redis: Redis) -> None:
    calls = 0

    def script(r: ModelRequest) -> ModelReply:
        nonlocal calls
        calls += 1
        return ModelReply(text="hi", usage=Usage(10, 1))

    h = await make_harness(Agent(instructions="t", model=ScriptedModel(script)), lease_ms=3000)
    sid = await h.sessions.create("o")
    real = h.store.submit
    sent = asyncio.Event()

    async def slow_reply(*args: Any, **kw: Any) -> Any:
        out = await real(*args, **kw)  # SUBMIT ran (and began the turn) ...
        sent.set()
        await asyncio.sleep(0.05)  # ... and the reply is still on its way when the caller goes
        return out

    h.store.submit = slow_reply  # type: ignore[method-assign]
    caller = asyncio.create_task(h.sessions.submit(sid, "o", "x", message_id="m1"))
    await sent.wait()
    caller.cancel()
    h.store.submit = real  # type: ignore[method-assign]
    res = await h.sessions.submit(sid, "o", "x", message_id="m1")  # the client's retry: the same message
    turn = await h.sessions.wait_turn(res, 2.5)  # well inside the 3 s lease: nothing waits for it to lapse
    assert turn.status == "completed"
    assert calls == 1 and (await h.sessions.info(sid, "o")).usage["model_calls"] == 1


async def test_a_flushed_script_cache_keeps_usage_before_the_commit(make_harness: Any, redis: Redis) -> None:
    @tool
    async def restart() -> str:
        """Stands in for a Redis restart or failover in the middle of a turn."""
        await redis.script_flush()
        return "done"

    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "user":
            return ModelReply(tool_calls=[ToolCall("restart", {})], usage=Usage(1, 1))
        return ModelReply(text="fin", usage=Usage(2, 2))

    h = await make_harness(Agent(instructions="t", model=ScriptedModel(script), tools=[restart]))
    sid = await h.sessions.create("o")
    res = await h.sessions.submit_and_wait(sid, "o", "go", context=None, message_id=None, timeout=5)
    types = [e.type for e in res.events]
    assert res.status == "completed" and types[-1] == "turn.completed"
    assert types.count("usage.recorded") == 2 and types.index("usage.recorded", 3) < types.index("message.completed")


async def test_a_waiter_hears_a_turn_run_elsewhere_while_this_process_waits_on_the_lease(
    make_harness: Any, redis: Redis
) -> None:
    release, hold = asyncio.Event(), asyncio.Event()

    async def slow(r: ModelRequest) -> ModelReply:
        text = r.messages[-1].text
        if text == "slow":
            await release.wait()
        elif text == "slower":
            await hold.wait()  # keeps P2 holding the lease after "quick"
        return ModelReply(text="re " + text, usage=Usage(1, 1))

    model = ScriptedModel(slow)
    other = await make_harness(Agent(instructions="t", model=model))  # "P2": runs the session first
    here = Harness(redis, Agent(instructions="t", model=model))  # "P1": will wait on P2's lease
    await here.start()
    try:
        sid = await other.sessions.create("o")
        await other.sessions.submit(sid, "o", "slow")
        quick = asyncio.create_task(
            here.sessions.submit_and_wait(sid, "o", "quick", context=None, message_id=None, timeout=3)
        )
        while await redis.llen(f"keel:{{{sid}}}:inbox") < 2:  # noqa: ASYNC110 (quick is queued)
            await asyncio.sleep(0.01)
        await other.sessions.submit(sid, "o", "slower")
        release.set()  # P2 finishes "slow", runs "quick", then holds on in "slower"
        result = await asyncio.wait_for(quick, 10)  # (3 s: less than the waiter's 5 s periodic look)
        assert result.status == "completed" and result.reply == "re quick"
    finally:
        hold.set()
        await here.stop()


async def test_a_session_let_go_as_its_turn_ends_takes_the_next_message_fast_and_frees_one_slot(
    make_harness: Any,
) -> None:
    """A turn whose final commit empties the inbox lets its session go before its task unwinds,
    and its waiter answers before that unwinding: a message sent as the answer arrives is begun
    by its own SUBMIT (no BEGIN after it), and the runner slot is given back once, so the runner
    still runs at most `concurrency` turns."""
    running = most = 0

    async def script(r: ModelRequest) -> ModelReply:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            if r.messages[-1].text == "slow":
                await asyncio.sleep(0.05)
        finally:
            running -= 1
        return ModelReply(text="re " + r.messages[-1].text, usage=Usage(1, 1))

    h = await make_harness(Agent(instructions="t", model=ScriptedModel(script)), concurrency=1)
    begins = 0
    real_begin = h.store.begin

    async def counted_begin(*args: Any, **kw: Any) -> Any:
        nonlocal begins
        begins += 1
        return await real_begin(*args, **kw)

    h.store.begin = counted_begin  # type: ignore[method-assign]
    sid = await h.sessions.create("o")
    for n in range(5):
        done = await h.sessions.submit_and_wait(sid, "o", f"m{n}", context=None, message_id=None, timeout=5)
        assert (done.status, done.reply) == ("completed", f"re m{n}")
        unwinding = [t for t in h.runner._tasks if t.get_name() == f"keel-session-{sid}" and not t.done()]
        assert unwinding, "the turn's task had unwound before its waiter answered"
        assert sid not in h.runner._hand and not h.runner._slots.locked()  # (let go already)
    assert begins == 0  # each message's SUBMIT began its turn: none waited for the last to unwind
    others = [await h.sessions.create("o") for _ in range(3)]
    results = await asyncio.gather(
        *(h.sessions.submit_and_wait(s, "o", "slow", context=None, message_id=None, timeout=5) for s in others)
    )
    assert [r.status for r in results] == ["completed"] * 3
    assert most == 1  # one slot: the sessions let go gave it back once each
    assert [i.text for i in await h.sessions.history(sid, "o")] == [t for n in range(5) for t in (f"m{n}", f"re m{n}")]


async def test_stopping_leaves_no_drain_behind_that_a_cancelled_submit_started(make_harness: Any) -> None:
    """A submit whose SUBMIT the stop cancels lets its session go, and a message accepted for
    the session meanwhile would start a drain as it does: the stop cancels that one too, and
    returns with no turn of this process still running (it would go on against a closed store)."""
    h = await make_harness(Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="re"))))
    sid = await h.sessions.create("o")
    real, held = h.store.submit, asyncio.Event()

    async def held_first(s: str, owner: str, message: Any, **kw: Any) -> Any:
        if message.text == "first":
            await held.wait()  # (never set: the stop cancels it before its SUBMIT goes out)
        return await real(s, owner, message, **kw)

    h.store.submit = held_first  # type: ignore[method-assign]
    first = asyncio.create_task(h.sessions.submit(sid, "o", "first"))
    while sid not in h.runner._hand:  # noqa: ASYNC110 (its session reserved, its SUBMIT held)
        await asyncio.sleep(0.001)
    await h.sessions.submit(sid, "o", "second")  # accepted meanwhile: kicks the reserved session
    await h.runner.stop()
    assert all(t.done() for t in h.runner._tasks), [t.get_name() for t in h.runner._tasks if not t.done()]
    with pytest.raises(asyncio.CancelledError):  # (its caller hears that it did not go through)
        await first

"""A runner whose process drains hands its sessions over at once (issue 15, item 5): the running
turn stops at its model call without committing it, the lease is released (not left to lapse),
a job for the session goes back on the stream, and another runner finishes the turn from its
last commit: nothing committed twice, nothing lost."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from harness import Agent, ToolContext, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from harness.store.keys import JOBS, JOBS_GROUP
from tests.events import env

LEASE_MS = 20_000  # far longer than any wait below: a takeover that waits for it fails the test


async def waiting_jobs(redis: Redis) -> tuple[int, int]:
    """(jobs on the turn job stream, of which read and not acknowledged)."""
    pending = await redis.xpending(JOBS, JOBS_GROUP)
    return await redis.xlen(JOBS), pending["pending"]


class Blocking:
    """A model whose calls block (until cancelled) while `block` is set; `entered` is set when
    one is blocked."""

    def __init__(self, reply: Any) -> None:
        self.block = True
        self.entered = asyncio.Event()
        self.calls: list[str] = []
        self.reply = reply

    async def __call__(self, request: ModelRequest) -> ModelReply:
        self.calls.append(request.turn_id)
        if self.block:
            self.entered.set()
            await asyncio.Event().wait()
        reply: ModelReply = self.reply(request)
        return reply


async def test_a_drain_hands_a_blocked_turn_to_another_runner_at_once(make_harness: Any, redis: Redis) -> None:
    model = Blocking(lambda r: ModelReply(text="re: " + r.messages[-1].text))
    agent = Agent(instructions="t", model=ScriptedModel(model))
    one = await make_harness(agent, lease_ms=LEASE_MS)
    sid = await one.sessions.create("anon")
    sent = await one.sessions.submit(sid, "anon", "hello")
    async with asyncio.timeout(10):
        await model.entered.wait()
    model.block = False

    assert await one.hand_over(5) == 1
    assert await redis.exists(f"keel:{{{sid}}}:lease") == 0  # released, not left to lapse
    jobs, pending = await waiting_jobs(redis)
    assert jobs >= 1 and pending == 0  # a job for the session read by no one; none held by `one`
    two = await make_harness(agent, lease_ms=LEASE_MS)
    turn = await two.sessions.wait_turn(sent, 5)  # well before the lease's 20 s
    assert turn.status == "completed" and turn.reply == "re: hello"
    types = [e.type for e in turn.events]
    assert types.count("turn.started") == 1 and types.count("turn.completed") == 1
    assert types.count("message.completed") == 1 and "turn.cancelled" not in types
    assert [env(e)["data"].get("failed") for e in turn.events if e.type == "usage.recorded"] == [True, None]
    assert (await two.sessions.info(sid, "anon")).usage["model_calls"] == 2  # the cut attempt counted too
    assert two.stats.lease_takeovers == 0 and one.stats.handed_over == 1  # given, not taken from a lapsed lease
    history = await two.sessions.history(sid, "anon")
    assert [(i.role, i.text) for i in history] == [("user", "hello"), ("assistant", "re: hello")]


async def test_a_tool_running_at_the_drain_finishes_and_commits_once(make_harness: Any, redis: Redis) -> None:
    ran: list[str] = []
    running, finish = asyncio.Event(), asyncio.Event()

    @tool
    async def slow(ctx: ToolContext) -> str:
        """A tool that takes its time."""
        ran.append(ctx.call_id)
        running.set()
        await finish.wait()
        return "slow done"

    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "user":
            return ModelReply(tool_calls=[ToolCall("slow", {})])
        return ModelReply(text="after " + r.messages[-1].text)

    model = ScriptedModel(script)
    agent = Agent(instructions="t", tools=[slow], model=model)
    one = await make_harness(agent, lease_ms=LEASE_MS)
    sid = await one.sessions.create("anon")
    sent = await one.sessions.submit(sid, "anon", "go")
    async with asyncio.timeout(10):
        await running.wait()
    draining = asyncio.create_task(one.hand_over(5))
    await asyncio.sleep(0)  # (one step of the drain's task: it has begun, and waits for the tool)
    assert one.runner.calls.handing_over and not draining.done()
    finish.set()
    assert await draining == 1
    assert await redis.exists(f"keel:{{{sid}}}:lease") == 0
    jobs, pending = await waiting_jobs(redis)
    assert jobs >= 1 and pending == 0
    two = await make_harness(agent, lease_ms=LEASE_MS)
    turn = await two.sessions.wait_turn(sent, 5)
    assert turn.status == "completed" and turn.reply == "after slow done"
    assert len(ran) == 1  # its result was committed before the hand-over: not run again
    types = [e.type for e in turn.events]
    assert types.count("tool.completed") == 1 and types.count("turn.completed") == 1
    assert len(model.requests) == 2  # the step before the tool was not recomputed


async def test_a_wait_for_a_turn_handed_over_hears_the_other_runner_at_once(make_harness: Any) -> None:
    """`?wait=true` in the process whose runner began the turn needs no notices while that
    runner writes it; once the turn leaves (a drain), the wait hears the runner that finishes it
    at once, not at its periodic look (5 s)."""
    model = Blocking(lambda r: ModelReply(text="re: " + r.messages[-1].text))
    agent = Agent(instructions="t", model=ScriptedModel(model))
    one = await make_harness(agent, lease_ms=LEASE_MS)
    sid = await one.sessions.create("anon")
    waiting = asyncio.create_task(
        one.sessions.submit_and_wait(sid, "anon", "hello", context=None, message_id=None, timeout=30)
    )
    async with asyncio.timeout(10):
        await model.entered.wait()
    model.block = False
    assert await one.hand_over(5) == 1
    await make_harness(agent, lease_ms=LEASE_MS)  # the runner that takes it
    async with asyncio.timeout(3):
        turn = await waiting
    assert turn.status == "completed" and turn.reply == "re: hello"


async def test_a_drain_handed_over_in_a_later_round_hands_its_session_over(make_harness: Any, redis: Redis) -> None:
    """A drain goes round again for a job read while a round ran. Handed over in that later
    round, it gives the session to another runner as any drain does: it once acknowledged its
    jobs instead (its first round had finished) and queued none for the turn it stopped, which
    then waited for good."""
    model = Blocking(lambda r: ModelReply(text="re: " + r.messages[-1].text))
    agent = Agent(instructions="t", model=ScriptedModel(model))
    one = await make_harness(agent, lease_ms=LEASE_MS)
    web = await make_harness(agent, run_turns=False)
    sid = await web.sessions.create("anon")
    real_begin, in_begin, gate = one.store.begin, asyncio.Event(), asyncio.Event()

    async def begin(*args: Any) -> Any:  # (the first round's BEGIN is slow to come back)
        out = await real_begin(*args)
        if not in_begin.is_set():
            in_begin.set()
            await gate.wait()
        return out

    one.store.begin = begin  # type: ignore[method-assign]
    await web.store.add_job(sid)  # a round with nothing to run
    async with asyncio.timeout(10):
        await in_begin.wait()
    sent = await web.sessions.submit(sid, "anon", "hello")  # its job read while that round waits
    async with asyncio.timeout(10):
        while (await waiting_jobs(redis))[1] < 2:  # noqa: ASYNC110 (read: no event says so)
            await asyncio.sleep(0.01)
    gate.set()
    async with asyncio.timeout(10):
        await model.entered.wait()  # the second round's turn, at its model call
    model.block = False

    assert await one.hand_over(5) == 1
    two = await make_harness(agent, lease_ms=LEASE_MS)
    turn = await two.sessions.wait_turn(sent, 5)  # well before the lease's 20 s
    assert turn.status == "completed" and turn.reply == "re: hello"

"""One writer per session (I4): runners that race for a session never both run or commit it."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from harness import Agent, tool
from harness.errors import StaleLease, Unavailable
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from harness.runner.state import InHand, Phase
from harness.store import Begun, Busy, JobId
from harness.store.keys import JOBS_GROUP, SessionKeys, job_shard, job_streams
from tests.events import env


async def test_racing_begins_let_exactly_one_runner_in(make_harness: Any) -> None:
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="x")))
    one = await make_harness(agent, run_turns=False)
    two = await make_harness(agent, run_turns=False)
    sid = await one.sessions.create("anon")
    for n in range(30):
        await one.sessions.submit(sid, "anon", f"m{n}")
        a, b = await asyncio.gather(one.store.begin(sid, "", 5_000), two.store.begin(sid, "", 5_000))
        winners = [x for x in (a, b) if isinstance(x, Begun)]
        assert len(winners) == 1 and any(isinstance(x, Busy) for x in (a, b))
        winner = winners[0]
        with pytest.raises(StaleLease):  # a made-up (or older) token commits nothing
            await two.store.commit(sid, str(int(winner.fence) - 1), winner.message.turn_id, [], [], mode="final")
        await one.store.commit(sid, winner.fence, winner.message.turn_id, [], [], mode="final")
    assert await one.store.queued(sid) == 0


async def test_two_processes_running_one_session_never_overlap(make_harness: Any) -> None:
    inside = 0
    most = 0
    rng = random.Random(7)

    async def script(r: ModelRequest) -> ModelReply:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        await asyncio.sleep(rng.random() / 200)  # a model that takes a moment, so runners can collide
        inside -= 1
        return ModelReply(text=f"re:{r.messages[-1].text}")

    model = ScriptedModel(script)
    one = await make_harness(Agent(instructions="t", model=model))
    two = await make_harness(Agent(instructions="t", model=model))
    sid = await one.sessions.create("anon")
    sent = [await (one, two)[n % 2].sessions.submit(sid, "anon", f"m{n}") for n in range(20)]
    for res in sent:
        assert (await one.sessions.wait_turn(res, 20)).status == "completed"
    assert most == 1
    texts = [i.text for i in await one.sessions.history(sid, "anon")]
    assert texts == [x for n in range(20) for x in (f"m{n}", f"re:m{n}")]
    assert len(model.requests) == 20


async def test_a_worker_goes_on_when_redis_lost_the_job_stream(make_harness: Any, redis: Any) -> None:
    """A Redis restarted without persistence (or flushed) has no job stream and no consumer
    group: a worker (blocked reading the stream meanwhile) makes them again and runs the next
    message a web process accepts."""
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="hi")))
    await make_harness(agent)  # the worker
    web = await make_harness(agent, run_turns=False)
    sid = await web.sessions.create("anon")
    assert (await web.sessions.wait_turn(await web.sessions.submit(sid, "anon", "before"), 10)).reply == "hi"
    await redis.flushall()  # sessions, the stream and its group: gone
    sid = await web.sessions.create("anon")
    turn = await web.sessions.wait_turn(await web.sessions.submit(sid, "anon", "after"), 10)
    assert turn.status == "completed" and turn.reply == "hi"


async def test_a_job_is_acknowledged_on_the_stream_it_came_from(make_harness: Any, redis: Any) -> None:
    """A session's job on another stream than its shard (written by a keel that chose shards
    otherwise, before an upgrade) runs the session's message and is acknowledged where it is:
    it is not left there to be reclaimed again and again."""
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="hi")))
    web = await make_harness(agent, run_turns=False, job_shards=4)
    sid = await web.sessions.create("anon")
    streams = job_streams(4)
    own, other = streams[job_shard(sid, 4)], streams[(job_shard(sid, 4) + 1) % 4]
    sent = await web.sessions.submit(sid, "anon", "hello")
    ((job, _),) = await redis.xrange(own)
    await redis.xdel(own, job)  # (the job as the earlier keel wrote it: on another stream)
    await redis.xadd(other, {"s": sid})
    await make_harness(agent, job_shards=4)  # the worker
    assert (await web.sessions.wait_turn(sent, 10)).reply == "hi"
    async with asyncio.timeout(5):
        while await redis.xlen(other):  # noqa: ASYNC110 (acknowledged within ACK_DELAY_S: no event to wait on)
            await asyncio.sleep(0.01)
    assert await redis.xlen(own) == 0 and (await redis.xpending(other, "runners"))["pending"] == 0


def test_a_job_of_another_stream_is_never_taken_as_seen_by_a_drain() -> None:
    """Around an upgrade that moved a session's shard its jobs are on two streams, whose ids do
    not order their writes (another node's stream, the same millisecond): such a job makes the
    drain go round again instead of being acknowledged as seen, which could leave its message
    waiting in the inbox."""
    state = InHand(Phase.DRAINING)
    state.got(JobId(1_000, 5, shard=0))
    mark = state.round()
    assert mark == JobId(1_000, 5, shard=0) and not state.again
    assert state.covers(JobId(1_000, 4, shard=0))  # (the same stream: added before the mark)
    elsewhere = JobId(1_000, 0, shard=1)  # (added after the drain began, on another stream)
    assert not state.covers(elsewhere) and not elsewhere.seen_by(mark)
    state.got(elsewhere)
    assert state.again


async def test_a_drain_that_fails_after_a_round_leaves_its_jobs_pending(make_harness: Any, redis: Any) -> None:
    """A drain goes round again for a job read while it ran. If storage fails in that later
    round (a primary dying mid-turn), the jobs read stay pending, to be reclaimed: acknowledged
    (as they were, the first round having finished), the answer that the later round was
    resuming had no job left, and its turn never ran again (the failover soak saw a session
    `running` for good after an accepted answer)."""

    @tool(approval=True)
    def charge(amount: int) -> str:
        """Charge."""
        return f"charged {amount}"

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "user" and last.text == "pay":
            return ModelReply(tool_calls=[ToolCall("charge", {"amount": 5})])
        return ModelReply(text=f"re:{last.text}")

    agent = Agent(instructions="t", tools=[charge], model=ScriptedModel(script))
    worker = await make_harness(agent, lease_ms=300)
    web = await make_harness(agent, run_turns=False)  # (accepts; the worker runs what its jobs say)
    sid = await web.sessions.create("anon")
    first = await web.sessions.submit(sid, "anon", "pay")
    paused = await web.sessions.wait_turn(first, 10)
    assert paused.status == "waiting"
    (request,) = env(paused.events[-1])["data"]["requests"]

    # the next round's BEGIN (a message queued behind the paused turn: nothing to run) is slow to
    # come back; meanwhile the answer's job is read
    real_begin, in_begin, gate = worker.store.begin, asyncio.Event(), asyncio.Event()

    async def begin(*args: Any) -> Any:
        out = await real_begin(*args)
        if not in_begin.is_set():
            in_begin.set()
            await gate.wait()
        return out

    worker.store.begin = begin
    after = await web.sessions.submit(sid, "anon", "after")
    async with asyncio.timeout(10):
        await in_begin.wait()
    await web.sessions.respond(sid, "anon", request["request_id"], "approve")
    stream = worker.store.jobs.of(sid).stream
    async with asyncio.timeout(10):  # (the worker read the answer's job: no event says so)
        while (await redis.xpending(stream, JOBS_GROUP))["pending"] < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    # the round that resumes the answered turn fails at its first commit, storage gone
    real_commit, failed = worker.store.commit, []

    async def commit(sid_: str, fence: str, turn_id: str, *args: Any, **kw: Any) -> Any:
        if turn_id == first.turn_id and not failed:
            failed.append(turn_id)
            raise Unavailable("storage is unavailable (a failover, say)")
        return await real_commit(sid_, fence, turn_id, *args, **kw)

    worker.store.commit = commit
    gate.set()
    done = await web.sessions.wait_turn(after, 15)  # (it runs once the answered turn ended)
    assert failed and done.status == "completed" and done.reply == "re:after"
    history = await web.sessions.history(sid, "anon")
    assert [(i.role, i.text) for i in history] == [
        ("user", "pay"),
        ("assistant", ""),
        ("tool", "charged 5"),  # (once: the failed round committed nothing)
        ("assistant", "re:charged 5"),
        ("user", "after"),
        ("assistant", "re:after"),
    ]


def test_a_session_s_job_stream_is_in_the_part_of_the_slot_range_its_session_is_in() -> None:
    """So that on a cluster whose primaries hold even ranges of slots a session's jobs live on
    its node (but where a node's range ends inside a part), and a message's job rides in its
    SUBMIT's write instead of a round trip of its own to another node."""

    def part(slot: int, shards: int) -> int:  # (`job_streams`' parts: [n * H // shards, (n + 1) * H // shards))
        return next(n for n in range(shards) if slot < (n + 1) * REDIS_CLUSTER_HASH_SLOTS // shards)

    for shards in (2, 3, 7, 8, 16):
        streams = job_streams(shards)
        for n in range(500):
            sid = f"ses_{n:024x}"
            stream = streams[job_shard(sid, shards)]
            assert part(key_slot(stream.encode()), shards) == part(key_slot(SessionKeys(sid).meta.encode()), shards)
    for slot in (0, 5460, 5461, 10922, 10923, 16383):  # (the parts' edges with 3 shards)
        sid = next(f"s{n}" for n in range(100_000) if key_slot(f"{{s{n}}}".encode()) == slot)
        assert job_shard(sid, 3) == part(slot, 3), slot
    assert job_shard("ses_x", 1) == 0

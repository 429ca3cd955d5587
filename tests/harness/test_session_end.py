"""The end of a session, in the harness and the store: DELETE removes every key at once, owner
only; a runner still holding the lease cannot write anything back into a deleted session; a
message racing the delete never leaves half a session; a history cached by another process is
not taken for a session made again under the same id; the readers are told (here and in
another process). The session TTL: test_session_ttl.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from harness import Agent, Harness
from harness.errors import NotFound, StaleLease
from harness.events import LiveEvent, StoredEvent, TurnCompletedData, pending
from harness.models import ModelReply, ModelRequest, ScriptedModel
from harness.store import Begun, Deliveries, NoWork, Store, UsageRecord
from harness.store.keys import DeliveryKeys, SessionKeys
from harness.types import InboxMessage, Item, Usage
from tests.channels.slack_support import eventually
from tests.harness.session_keys import keys_of


def message(text: str, n: int) -> InboxMessage:
    return InboxMessage(message_id=f"m{n}", turn_id=f"turn_{n}", text=text)


def blocking_agent(in_call: asyncio.Event, gate: asyncio.Event, cut: asyncio.Event) -> Agent:
    """A model call that says it began (`in_call`), waits for `gate`, and notes an interrupt (`cut`)."""

    async def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].text == "slow":
            in_call.set()
            try:
                await gate.wait()
            except asyncio.CancelledError:
                cut.set()
                raise
        return ModelReply(text="re:" + r.messages[-1].text)

    return Agent(instructions="t", model=ScriptedModel(script))


def echo() -> Agent:
    return Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="re:" + r.messages[-1].text)))


# ---- the store -----------------------------------------------------------------------------


async def test_a_runner_holding_the_lease_writes_nothing_into_a_deleted_session(redis: Redis, stores: Any) -> None:
    store = stores()
    await store.start()
    sid = "ses_0000000000000000000000dead"
    await store.create(sid, "o", {})
    await store.submit(sid, "o", message("hi", 1))
    begun = await store.begin(sid, "", 5_000)
    assert isinstance(begun, Begun)
    fence = begun.fence
    assert await keys_of(redis, sid)

    assert await store.delete(sid, "o") == "turn_1"  # the turn in progress, to be told to stop
    assert await keys_of(redis, sid) == set()

    item = Item(id="it_1", role="assistant", text="late", turn_id="turn_1")
    usage = UsageRecord(step=0, usage=Usage(input_tokens=5, output_tokens=1))
    done = pending("turn_1", TurnCompletedData("m1", "late"))
    for mode in ("step", "final", "pause"):
        with pytest.raises(StaleLease):
            await store.commit(sid, fence, "turn_1", [item], [done], mode=mode, usage=usage)  # type: ignore[arg-type]
    with pytest.raises(StaleLease):
        await store.record_usage(sid, "turn_1", 0, Usage(input_tokens=5), failed=True)
    with pytest.raises(StaleLease):
        await store.count_attempt(sid)
    assert not await store.renew(sid, fence, 5_000)
    await store.release(sid, fence)
    assert isinstance(await store.begin(sid, "", 5_000), NoWork)  # no session: nothing to run
    assert await keys_of(redis, sid) == set()  # not one key made again

    with pytest.raises(NotFound):
        await store.submit(sid, "o", message("again", 2))
    with pytest.raises(NotFound):
        await store.delete(sid, "o")
    assert await keys_of(redis, sid) == set()


async def test_delete_is_the_owners_only_and_takes_the_relay_keys_too(redis: Redis, stores: Any) -> None:
    store = stores()
    await store.start()
    sid = "ses_0000000000000000000000rly1"
    await store.create(sid, "o", {"where": "here"})
    await store.submit(sid, "o", message("hi", 1))
    deliveries = Deliveries(redis, store.wire)
    for dest in ("slack", "wh:wh_1"):
        state = await deliveries.take(sid, dest, "rly_1", 5_000)
        assert not isinstance(state, int) and state.exists
        assert await deliveries.mark(sid, dest, "rly_1", 5_000, cursor="1-0", keep={"r": "h"})
    before = await keys_of(redis, sid)
    assert DeliveryKeys(sid, "slack").state in before and DeliveryKeys(sid, "wh:wh_1").lease in before
    assert SessionKeys(sid).relays in before

    with pytest.raises(NotFound):
        await store.delete(sid, "someone else")
    assert await keys_of(redis, sid) == before  # another owner's delete changes nothing
    with pytest.raises(NotFound):
        await store.delete("ses_0000000000000000000000none", "o")

    assert await store.delete(sid, "o") == ""  # no turn was in progress
    assert await keys_of(redis, sid) == set()
    # a relay that still holds its lease writes no state back (and a new one finds no session)
    assert await deliveries.mark(sid, "slack", "rly_1", 5_000, cursor="2-0") is False
    state = await deliveries.take(sid, "slack", "rly_2", 5_000)
    assert not isinstance(state, int) and not state.exists
    assert await deliveries.mark(sid, "slack", "rly_2", 5_000, cursor="2-0", check="", release=True)
    assert await keys_of(redis, sid) == set()


async def test_a_history_cache_is_not_taken_for_a_session_made_again_under_its_id(stores: Any) -> None:
    """Two processes' stores: one ran turns of a session (its cache holds them); the session is
    deleted and made again under the same id (a webhook channel's conversation), and grows as
    long elsewhere. The first process must not take its old copy for the new history."""
    here, there = stores(), stores()
    await here.start()
    sid = "ses_0000000000000000000000agn1"

    async def turn(store: Store, n: int, text: str) -> list[str]:
        await store.submit(sid, "o", message(text, n), create={})
        begun = await store.begin(sid, "", 5_000)
        assert isinstance(begun, Begun)
        items = [
            Item(id=f"u{n}", role="user", text=text, turn_id=f"turn_{n}"),
            Item(id=f"a{n}", role="assistant", text="re:" + text, turn_id=f"turn_{n}"),
        ]
        await store.commit(sid, begun.fence, f"turn_{n}", items, [], mode="final")
        return [i.text for i in begun.history]

    await turn(there, 1, "old one")
    await turn(there, 2, "old two")  # `there` caches 4 items of the first session
    await here.delete(sid, "o")
    await turn(here, 3, "new one")
    await turn(here, 4, "new two")
    assert await turn(there, 5, "new three") == ["new one", "re:new one", "new two", "re:new two"]


async def test_a_message_racing_the_delete_leaves_no_half_session(make_harness: Any, redis: Redis) -> None:
    h: Harness = await make_harness(echo())
    for round_ in range(5):
        sid = await h.sessions.create("o")
        await h.sessions.submit(sid, "o", "first")
        sends = [asyncio.create_task(h.sessions.submit(sid, "o", f"m{n}")) for n in range(8)]
        await asyncio.sleep(0)  # (let some of them start)
        await h.sessions.delete(sid, "o")
        for result in await asyncio.gather(*sends, return_exceptions=True):
            assert not isinstance(result, BaseException) or isinstance(result, NotFound), result

        async def settled(sid: str = sid) -> bool:
            return h.runner is not None and not h.runner.runs(sid) and not await keys_of(redis, sid)

        await eventually(settled, 10, f"round {round_}: the session's keys are all gone")
        with pytest.raises(NotFound):
            await h.sessions.submit(sid, "o", "after")
        assert await keys_of(redis, sid) == set()


# ---- the harness: a turn in progress, readers ---------------------------------------------


async def test_delete_stops_the_turn_and_ends_every_reader_here(make_harness: Any, redis: Redis) -> None:
    in_call, gate, cut = asyncio.Event(), asyncio.Event(), asyncio.Event()
    h: Harness = await make_harness(blocking_agent(in_call, gate, cut), session_ttl_ms=60_000)
    sid = await h.sessions.create("o")
    seen: list[StoredEvent | LiveEvent] = []

    async def read(deltas: bool) -> None:
        async for event in h.store.outbox.tail(sid, "0-0", heartbeat=30, deltas=deltas):
            if event is not None:
                seen.append(event)

    readers = [asyncio.create_task(read(True)), asyncio.create_task(read(False))]
    await h.sessions.submit(sid, "o", "slow")
    await asyncio.wait_for(in_call.wait(), 5)
    with pytest.raises(NotFound):
        await h.sessions.delete(sid, "another owner")
    assert await keys_of(redis, sid)

    await h.sessions.delete(sid, "o")
    await asyncio.wait_for(cut.wait(), 5)  # the model call was cut at once
    await asyncio.wait_for(asyncio.gather(*readers), 5)  # both readers ended (heartbeat 30 s)
    ends = [e for e in seen if e.type == "session.deleted"]
    assert len(ends) == 2 and all(b'"reason":"deleted"' in e.raw and isinstance(e, LiveEvent) for e in ends)

    async def idle() -> bool:
        return h.runner is not None and not h.runner.runs(sid)

    await eventually(idle, 10)  # the runner tried its cancel commit: refused
    assert await keys_of(redis, sid) == set()
    with pytest.raises(NotFound):
        await h.sessions.info(sid, "o")


async def test_a_waiter_of_a_deleted_sessions_turn_gets_not_found(make_harness: Any) -> None:
    in_call, gate, cut = asyncio.Event(), asyncio.Event(), asyncio.Event()
    h: Harness = await make_harness(blocking_agent(in_call, gate, cut))
    sid = await h.sessions.create("o")
    waiting = asyncio.create_task(
        h.sessions.submit_and_wait(sid, "o", "slow", context=None, message_id=None, timeout=30)
    )
    await asyncio.wait_for(in_call.wait(), 5)
    await h.sessions.delete(sid, "o")
    with pytest.raises(NotFound):
        await asyncio.wait_for(waiting, 5)


async def test_a_reader_in_another_process_is_told(make_harness: Any, redis: Redis, valkey: Any) -> None:
    h: Harness = await make_harness(echo())
    other = Harness.connect(valkey.url, echo(), run_turns=False)  # its own client, hub and pub/sub
    await other.start()
    try:
        sid = await h.sessions.create("o")
        got: list[LiveEvent] = []

        async def read() -> None:
            async for event in other.sessions.tail(sid, "0-0", heartbeat=30):  # no periodic look in time
                if isinstance(event, LiveEvent):
                    got.append(event)

        reader = asyncio.create_task(read())

        async def subscribed() -> bool:
            return bool((await redis.pubsub_shardnumsub(SessionKeys(sid).live))[0][1])

        await eventually(subscribed, 5)
        await h.sessions.delete(sid, "o")
        await asyncio.wait_for(reader, 5)
        assert [e.type for e in got] == ["session.deleted"] and b'"reason":"deleted"' in got[0].raw
    finally:
        await other.stop()


async def test_a_reader_that_missed_the_notice_finds_the_session_gone(make_harness: Any, redis: Redis) -> None:
    h: Harness = await make_harness(echo(), run_turns=False)
    sid = await h.sessions.create("o")
    await h.store.delete(sid, "o")  # (the store alone: no notice to anyone)
    got: list[Any] = []
    async with asyncio.timeout(5):
        async for event in h.sessions.tail(sid, "0-0", heartbeat=0.1):
            got.append(event)
    assert got[-1] is not None and got[-1].type == "session.deleted" and b'"reason":"gone"' in got[-1].raw


# ---- the session TTL -----------------------------------------------------------------------

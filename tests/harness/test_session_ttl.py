"""The session TTL: every key of a session shares one deadline (each script that may make a key
gives it the session's), the delivery relay's state included; an idle session disappears whole;
an active one keeps everything; without a TTL nothing expires."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from harness import Agent, Harness, tool
from harness.errors import NotFound
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from harness.store import Begun, Deliveries
from harness.store.keys import DeliveryKeys, SessionKeys
from harness.types import Answer, ApprovalRequest, InboxMessage, Item
from tests.channels.slack_support import eventually
from tests.harness.session_keys import deadlines, keys_of


@tool(approval=True)
def wipe(target: str) -> str:
    """Wipe a target."""
    return f"wiped {target}"


def approving_agent() -> Agent:
    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "user" and last.text.startswith("wipe "):
            return ModelReply(tool_calls=[ToolCall("wipe", {"target": last.text[5:]})])
        return ModelReply(text="re:" + last.text)

    return Agent(instructions="t", tools=[wipe], model=ScriptedModel(script))


async def test_every_key_of_a_session_shares_one_deadline(make_harness: Any, redis: Redis) -> None:
    h: Harness = await make_harness(approving_agent(), session_ttl_ms=3_600_000)
    sid = await h.sessions.create("o")
    first = await deadlines(redis, sid)
    assert len(set(first.values())) == 1 and next(iter(first.values())) > 0
    r = await h.sessions.submit_and_wait(sid, "o", "hi", context={"page": "p1"}, message_id=None, timeout=10)
    assert r.status == "completed"
    r = await h.sessions.submit_and_wait(sid, "o", "wipe disk", context=None, message_id=None, timeout=10)
    assert r.status == "waiting"  # a pause: its requests made `pending`
    paused = await deadlines(redis, sid)
    assert {SessionKeys(sid).pending, SessionKeys(sid).sticky, SessionKeys(sid).history} <= set(paused)
    assert len(set(paused.values())) == 1, paused
    (rid,) = await h.sessions.pending(sid, "o")
    await h.sessions.respond(sid, "o", rid, "approve")  # `decisions` made by the answer
    assert SessionKeys(sid).decisions in await deadlines(redis, sid)
    assert len(set((await deadlines(redis, sid)).values())) == 1
    r = await h.sessions.submit_and_wait(sid, "o", "again", context=None, message_id=None, timeout=10)
    assert r.status == "completed"
    last = await deadlines(redis, sid)
    assert len(set(last.values())) == 1 and set(last) >= set(paused) - {SessionKeys(sid).inbox}  # (emptied)
    assert next(iter(last.values())) >= next(iter(paused.values()))


async def test_every_write_leaves_the_session_on_one_deadline(redis: Redis, stores: Any) -> None:
    """Each script that may make a key of a session gives it the session's deadline: the ones
    that keep the session set them all, the others copy meta's to the key they made."""
    store = stores()
    store.ttl_ms = 3_600_000
    await store.start()

    async def one(sid: str) -> int:
        at = await deadlines(redis, sid)
        assert len(set(at.values())) == 1 and -1 not in at.values(), at
        return next(iter(at.values()))

    ops = "ses_0000000000000000000000ttl0"
    await store.create(ops, "o", {})
    await store.cancel(ops, "o", once="stop-1")  # `mids` made by a cancel's id
    await one(ops)
    await store.enqueue(ops, "o", InboxMessage(message_id="c1", turn_id="turn_c", kind="compact"))  # `inbox`
    await one(ops)

    sid = "ses_0000000000000000000000ttl1"
    await store.create(sid, "o", {})
    created = await one(sid)
    await store.submit(sid, "o", InboxMessage(message_id="m1", turn_id="turn_1", text="wipe", sticky={"page": "p"}))
    assert await one(sid) == created  # `inbox`, `mids`: the session's deadline (a fresh one is left as it is)
    store.ttl_ms = 7_200_000  # (so that a keep shows: the deadline moves an hour on)
    await store.submit(sid, "o", InboxMessage(message_id="m2", turn_id="turn_2", text="later"))
    submitted = await one(sid)
    assert submitted > created + 3_000_000  # a message keeps the session
    begun = await store.begin(sid, "", 5_000)
    assert isinstance(begun, Begun)
    await one(sid)  # `sticky`
    item = Item(id="it_1", role="assistant", text="asking", turn_id="turn_1")
    await store.commit(sid, begun.fence, "turn_1", [item], [], mode="step")
    await one(sid)  # `history`
    request = ApprovalRequest("req_1", "call_1", "wipe", {}, "turn_1")
    await store.commit(sid, begun.fence, "turn_1", [], [], mode="step", requests=[request])
    before = await one(sid)  # `pending`
    assert before == submitted  # (no step keeps the session)
    await store.respond(sid, "o", "req_1", Answer("approve"))
    assert await one(sid) == before  # `decisions`, with the others
    assert SessionKeys(sid).decisions in await deadlines(redis, sid)
    store.ttl_ms = 14_400_000
    await store.commit(sid, begun.fence, "turn_1", [], [], mode="final")  # the turn's end keeps the session
    ended = await one(sid)
    assert ended > before + 3_000_000
    await store.submit(sid, "o", InboxMessage(message_id="m3", turn_id="turn_3", text="soon after"))
    assert await one(sid) == ended  # a deadline this fresh is left as it is (no PEXPIRE per key)


async def test_a_lease_given_up_after_its_session_expired_makes_nothing_again(redis: Redis, stores: Any) -> None:
    """A session's lease has a deadline of its own and may outlive the rest of the session: a
    runner that gives it up (a drain's hand-over) once the session expired writes nothing of it
    again, no meta without an owner or an expiry left behind for good."""
    store = stores()
    store.ttl_ms = 3_600_000
    await store.start()
    sid = "ses_0000000000000000000000ttl2"
    await store.create(sid, "o", {})
    await store.submit(sid, "o", InboxMessage(message_id="m1", turn_id="turn_1", text="hi"))
    begun = await store.begin(sid, "", 60_000)
    assert isinstance(begun, Begun)
    lease = SessionKeys(sid).lease
    await redis.delete(*(await keys_of(redis, sid) - {lease}))  # (as the session's deadline does: all but the lease)
    await store.release(sid, begun.fence)
    assert await keys_of(redis, sid) == set()


async def test_without_a_ttl_nothing_of_a_session_expires_but_old_events(make_harness: Any, redis: Redis) -> None:
    h: Harness = await make_harness(
        approving_agent(), session_ttl_ms=0, event_retention_ms=3_600_000, idempotency_ms=3_600_000
    )
    sid = await h.sessions.create("o")
    await h.sessions.submit_and_wait(sid, "o", "wipe disk", context={"page": "p"}, message_id=None, timeout=10)
    at = await deadlines(redis, sid)
    outbox = at.pop(SessionKeys(sid).outbox)
    assert set(at.values()) == {-1}
    # the events: an hour after the newest of them (and up to a hundredth of it more: see lua._EMIT)
    (newest,) = await redis.xrevrange(SessionKeys(sid).outbox, count=1)
    newest_ms = int(newest[0].split(b"-")[0])
    assert newest_ms + 3_600_000 <= outbox <= newest_ms + 3_600_000 + 36_000


async def test_an_idle_session_disappears_whole(make_harness: Any, redis: Redis) -> None:
    ttl = 300
    h: Harness = await make_harness(approving_agent(), session_ttl_ms=ttl)
    sid = await h.sessions.create("o")
    await h.sessions.submit_and_wait(sid, "o", "wipe disk", context={"page": "p"}, message_id=None, timeout=10)
    full = await keys_of(redis, sid)
    k = SessionKeys(sid)
    # paused for approval (and this process named as a reader, expiring with the session)
    assert full - {k.readers} == {k.meta, k.inbox, k.history, k.sticky, k.outbox, k.pending, k.mids}
    seen: list[int] = []

    async def gone() -> bool:
        now = await keys_of(redis, sid)
        seen.append(len(now - {k.readers}))
        return not now

    await eventually(gone, 5)
    assert all(n in (0, len(full - {k.readers})) for n in seen), f"a partial session was seen: {seen}"
    with pytest.raises(NotFound):
        await h.sessions.info(sid, "o")


async def test_an_active_session_keeps_every_key(make_harness: Any, redis: Redis) -> None:
    # (a TTL well above a pause of this process: at 400 ms, a full local run once saw the
    # session expire between the last turn and the reads after it)
    ttl = 1_000
    h: Harness = await make_harness(approving_agent(), session_ttl_ms=ttl)
    sid = await h.sessions.create("o")
    loop = asyncio.get_running_loop()
    began, n = loop.time(), 0
    while loop.time() - began < 2 * ttl / 1000:  # turns for two TTLs, each well within one
        n += 1
        r = await h.sessions.submit_and_wait(sid, "o", f"m{n}", context={"page": str(n)}, message_id=None, timeout=10)
        assert r.status == "completed"
        assert len(set((await deadlines(redis, sid)).values())) == 1
    assert len(await h.sessions.history(sid, "o")) == 2 * n
    assert (await h.sessions.info(sid, "o")).usage["model_calls"] == n


async def test_relay_state_expires_with_its_session_and_is_not_written_after(redis: Redis, stores: Any) -> None:
    store = stores()
    store.ttl_ms = 3_600_000
    await store.start()
    sid = "ses_0000000000000000000000rly2"
    await store.create(sid, "o", {})
    deliveries = Deliveries(redis, store.wire)
    state = await deliveries.take(sid, "slack", "rly_1", 60_000)
    assert not isinstance(state, int) and state.exists
    assert await deliveries.mark(sid, "slack", "rly_1", 60_000, cursor="1-0")
    k, d = SessionKeys(sid), DeliveryKeys(sid, "slack")
    meta_at = await redis.pexpiretime(k.meta)
    assert meta_at > 0 and await redis.pexpiretime(d.state) == meta_at == await redis.pexpiretime(k.relays)
    await redis.pexpire(k.meta, 1)  # the session's deadline comes (as if it expired: meta first)

    async def expired() -> bool:
        return not await redis.exists(k.meta)

    await eventually(expired, 5)
    await redis.delete(d.state)
    # the relay still holds its lease: it writes no state into a session that is no more
    assert await deliveries.mark(sid, "slack", "rly_1", 60_000, cursor="2-0", keep={"r": "h"})
    assert not await redis.exists(d.state)

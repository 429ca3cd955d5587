"""Memory by design: a session keeps its events for `event_retention_ms` (then the outbox is
trimmed, and a session left alone keeps none), a message id for `idempotency_ms` (a repeat
within it is the same message, after it a new one), and in its history list only the active
history (what a compaction or a clear replaced leaves Redis); nothing a user is promised is lost
on the way: `history`, turns, the cache of history and forks go on as before."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from redis.asyncio import Redis

from app.settings import Settings, SettingsError
from harness import Agent, Harness
from harness.errors import Conflict, NotFound
from harness.ids import new_id
from harness.loop.compaction import Compaction
from harness.models import ModelReply, ModelRequest, ScriptedModel
from harness.store import AlreadyAnswered, Begun, Store
from harness.store.keys import SessionKeys
from harness.types import InboxMessage
from tests.channels.slack_support import eventually
from tests.harness.test_approvals import gated_agent


def echo() -> ScriptedModel:
    def script(r: ModelRequest) -> ModelReply:
        if r.purpose == "compaction":
            return ModelReply(text="SUMMARY")
        return ModelReply(text="re: " + r.messages[-1].text)

    return ScriptedModel(script)


async def say(h: Harness, sid: str, text: str, message_id: str | None = None) -> Any:
    turn = await h.sessions.submit_and_wait(sid, "o", text, context=None, message_id=message_id, timeout=10)
    assert turn.status == "completed", turn
    return turn


async def test_events_older_than_the_window_leave_the_outbox(make_harness: Any, redis: Redis) -> None:
    h: Harness = await make_harness(Agent(instructions="t", model=echo()), event_retention_ms=400, idempotency_ms=400)
    sid = await h.sessions.create("o")
    outbox = SessionKeys(sid).outbox
    for n in range(40):  # 5 events a turn: two stream nodes of 100 and more
        await say(h, sid, f"m{n}")
    assert await redis.xlen(outbox) == 1 + 40 * 5

    async def trimmed() -> bool:  # (each turn trims what is older than the window by then)
        await say(h, sid, "later")
        return int(await redis.xlen(outbox)) < 100

    await eventually(trimmed, 10)
    # the session goes on: its history whole, its new turns' events read from where a reader is
    assert [i.text for i in await h.sessions.history(sid, "o")][:2] == ["m0", "re: m0"]
    events = await h.store.outbox.events(sid, "0-0")
    assert events[-1].type == "turn.completed" and events[0].seq > 1


async def test_a_session_left_alone_keeps_no_events_and_goes_on(make_harness: Any, redis: Redis) -> None:
    h: Harness = await make_harness(Agent(instructions="t", model=echo()), event_retention_ms=300, idempotency_ms=300)
    sid = await h.sessions.create("o")
    await say(h, sid, "hello")
    keys = SessionKeys(sid)
    assert 0 < await redis.pttl(keys.outbox) <= 303  # the window and a hundredth of it (see lua._EMIT)

    async def gone() -> bool:
        return not await redis.exists(keys.outbox)

    await eventually(gone, 5)
    assert await redis.exists(keys.meta, keys.history) == 2  # the session itself stays
    turn = await say(h, sid, "again")  # its next events follow the last ones
    seqs = [e.seq for e in turn.events]
    assert seqs[0] == 7 and seqs == list(range(7, 7 + len(seqs)))  # (session.created and 5 a turn before)
    assert [e.seq for e in await h.store.outbox.events(sid, "0-0")] == seqs
    assert [i.text for i in await h.sessions.history(sid, "o")] == ["hello", "re: hello", "again", "re: again"]


async def test_a_message_id_is_the_same_message_within_the_window_only(make_harness: Any, redis: Redis) -> None:
    h: Harness = await make_harness(Agent(instructions="t", model=echo()), idempotency_ms=300)
    sid = await h.sessions.create("o")
    first = await say(h, sid, "pay", message_id="order-1")
    again = await h.sessions.submit(sid, "o", "pay", message_id="order-1")
    assert again.duplicate and again.turn_id == first.events[0].decoded().turn_id
    mids = SessionKeys(sid).mids
    assert 0 < (await redis.hpttl(mids, "order-1"))[0] <= 300

    async def forgotten() -> bool:
        return not await redis.hexists(mids, "order-1")

    await eventually(forgotten, 5)
    later = await say(h, sid, "pay", message_id="order-1")  # a new message now
    assert later.events[0].decoded().turn_id != first.events[0].decoded().turn_id
    assert [i.text for i in await h.sessions.history(sid, "o")].count("pay") == 2


async def test_a_waited_repeat_of_a_message_whose_turn_left_the_outbox_says_so_at_once(
    make_harness: Any, redis: Redis
) -> None:
    """A busy session's outbox kept by count (`retention`) can lose a turn's events while its
    message id is still remembered: a `?wait=true` of that message again cannot be told how its
    turn came out, and says so at once (it waited out its timeout, then said `pending`); one
    whose turn's ending is kept is answered as before."""
    h: Harness = await make_harness(Agent(instructions="t", model=echo()), retention=100)
    sid = await h.sessions.create("o")
    await say(h, sid, "first", message_id="order-1")
    for n in range(60):  # 5 events a turn: far past 100, whole stream nodes trimmed
        await say(h, sid, f"m{n}", message_id=f"later-{n}")
    first_kept = (await h.store.outbox.events(sid, "0-0", count=1))[0]
    assert first_kept.seq > 6  # (the first turn's events, seq 2-6, are gone)

    async def again(message_id: str, timeout: float) -> Any:
        return await h.sessions.submit_and_wait(sid, "o", "first", context=None, message_id=message_id, timeout=timeout)

    with pytest.raises(Conflict) as gone:
        await asyncio.wait_for(again("order-1", 30), 5)
    assert gone.value.code == "turn_events_gone"
    kept = await again("later-59", 5)  # (its turn's events still there)
    assert kept.status == "completed" and kept.reply == "re: m59"
    assert len(await h.sessions.history(sid, "o")) == 2 * 61  # (nothing run again)

    # a fork holds the messages it copied, not their turns' events: the same answer there
    fork = await h.sessions.fork(sid, "o")
    with pytest.raises(Conflict) as copied:
        await asyncio.wait_for(
            h.sessions.submit_and_wait(fork, "o", "m59", context=None, message_id="later-59", timeout=30), 5
        )
    assert copied.value.code == "turn_events_gone" and "fork" in str(copied.value)
    assert len(await h.sessions.history(fork, "o")) == 2 * 61


async def window_passed(redis: Redis, ms: int) -> None:
    """Until `ms` of the server's time passed from now: a probe field with that expiry is gone."""
    probe = f"probe:{new_id('w')}"
    await redis.hset(probe, "f", "1")
    await redis.execute_command("HPEXPIRE", probe, ms, "FIELDS", 1, "f")

    async def gone() -> bool:
        return not await redis.exists(probe)

    await eventually(gone, 5)


async def test_a_message_id_is_remembered_while_its_turn_waits_and_the_window_after(
    make_harness: Any, redis: Redis
) -> None:
    """A client resends the message of a turn that still waits for approval, later than the
    window (a reconnecting UI resends what it has no answer for): its turn is in progress, so it
    is the same message, not a second turn. The window starts when the turn ends."""
    agent, _ = gated_agent([])
    h: Harness = await make_harness(agent, idempotency_ms=300)
    sid = await h.sessions.create("anon")
    first = await h.sessions.submit_and_wait(sid, "anon", "delete /x", context=None, message_id="m1", timeout=10)
    assert first.status == "waiting"
    await window_passed(redis, 300)
    again = await h.sessions.submit(sid, "anon", "delete /x", message_id="m1")
    assert again.duplicate and again.turn_id == first.events[0].decoded().turn_id
    assert await h.store.queued(sid) == 1  # (the waiting turn's message only)
    (rid,) = await h.sessions.pending(sid, "anon")
    assert (await h.sessions.respond_and_wait(sid, "anon", rid, "approve", timeout=10)).status == "completed"
    mids = SessionKeys(sid).mids
    assert 0 < (await redis.hpttl(mids, "m1"))[0] <= 300  # from the turn's end

    async def forgotten() -> bool:
        return not await redis.hexists(mids, "m1")

    await eventually(forgotten, 5)
    received = [e for e in await h.store.outbox.events(sid, "0-0") if e.type == "message.received"]
    assert len(received) == 1


async def running(store: Store) -> tuple[str, Begun]:
    """A new session whose first message's turn (`turn_head`, message `m-head`) is begun."""
    sid = new_id("ses")
    await store.create(sid, "o", {})
    await store.submit(sid, "o", InboxMessage(message_id="m-head", turn_id="turn_head", text="head"))
    begun = await store.begin(sid, "", 60_000)
    assert isinstance(begun, Begun)
    return sid, begun


async def test_a_queued_or_steered_message_id_is_remembered_until_its_turn_ends(redis: Redis) -> None:
    """A message that waits in the queue behind a long turn, and one steered into that turn,
    resent later than the window: the same messages (neither is queued again); their windows
    start when the turns they are in end."""
    store = Store(redis, idempotency_ms=300)
    await store.start()
    try:
        sid, begun = await running(store)
        queued = InboxMessage(message_id="m-queued", turn_id="turn_queued", text="queued")
        steered = InboxMessage(message_id="m-steered", turn_id="turn_steered", text="steered")
        await store.submit(sid, "o", queued)
        assert (await store.submit(sid, "o", steered, policy="steer")).steered
        await window_passed(redis, 300)
        for m in (queued, steered):
            assert (await store.submit(sid, "o", m, policy="queue")).duplicate, m.message_id
        assert await store.queued(sid) == 2
        mids = SessionKeys(sid).mids
        step = await store.commit(sid, begun.fence, "turn_head", [], [], attempt=True)  # takes the steered one
        assert [i.message_id for i in step.steered] == ["m-steered"]
        assert [t for t in await redis.hpttl(mids, "m-head", "m-queued", "m-steered")] == [-1, -1, -1]
        await store.commit(sid, begun.fence, "turn_head", [], [], mode="final")
        head, queued_ttl, steered_ttl = await redis.hpttl(mids, "m-head", "m-queued", "m-steered")
        assert 0 < head <= 300 and 0 < steered_ttl <= 300 and queued_ttl == -1  # (its turn is next)
    finally:
        await store.close()


async def test_a_redis_without_field_expiry_remembers_ids_for_the_session(
    make_harness: Any, redis: Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from harness.store import Store

    async def no_field_expiry(self: Store) -> bool:
        return False

    monkeypatch.setattr(Store, "_field_expiry", no_field_expiry)
    with caplog.at_level(logging.WARNING):
        h: Harness = await make_harness(Agent(instructions="t", model=echo()), idempotency_ms=300)
    assert any("HPEXPIRE" in r.message for r in caplog.records)
    sid = await h.sessions.create("o")
    await say(h, sid, "pay", message_id="order-1")
    assert (await redis.hpttl(SessionKeys(sid).mids, "order-1"))[0] == -1  # no expiry of its own
    assert (await h.sessions.submit(sid, "o", "pay", message_id="order-1")).duplicate


async def test_history_a_compaction_replaced_leaves_the_list(make_harness: Any, redis: Redis) -> None:
    model = echo()
    agent = Agent(instructions="t", model=model, context_window=400, compaction=Compaction(keep_turns=1))
    h: Harness = await make_harness(agent)
    other: Harness = await make_harness(agent, run_turns=False)  # a second process: a cache of its own
    sid = await h.sessions.create("o")
    compactions = 0
    for n in range(30):
        await say(h, sid, f"message {n} " + "m" * 120)
        history = await h.sessions.history(sid, "o")
        # the list holds the active history only, whatever was compacted away before
        assert await redis.llen(SessionKeys(sid).history) == len(history)
        assert history == await other.sessions.history(sid, "o")
        compactions += history[0].kind == "summary"
    assert compactions >= 5
    assert [r.purpose for r in model.requests].count("compaction") >= 2
    # the model is shown the active history: the summary, then the kept turns (no gap, no repeat)
    last = [m for m in model.requests if m.purpose == "turn"][-1]
    texts = [m.text for m in last.messages if m.role == "user" and m.kind == "message"]
    assert texts[-1].startswith("message 29 ") and len(set(texts)) == len(texts)
    # a page of it from an offset, as GET .../history gives it
    assert await h.sessions.history(sid, "o", offset=1, limit=2) == history[1:3]
    # a fork has the active history, and runs turns of its own
    fork = await h.sessions.fork(sid, "o")
    assert await h.sessions.history(fork, "o") == history
    await say(h, fork, "in the fork")


async def test_clear_leaves_an_empty_list(make_harness: Any, redis: Redis) -> None:
    h: Harness = await make_harness(Agent(instructions="t", model=echo()), session_ttl_ms=3_600_000)
    sid = await h.sessions.create("o")
    await say(h, sid, "one")
    await h.sessions.clear(sid, "o")

    async def cleared() -> bool:  # (the clear runs as a job)
        return not await redis.exists(SessionKeys(sid).history)

    await eventually(cleared, 5)
    await say(h, sid, "two")
    assert [i.text for i in await h.sessions.history(sid, "o")] == ["two", "re: two"]
    assert await redis.llen(SessionKeys(sid).history) == 2
    assert await redis.pttl(SessionKeys(sid).history) > 0  # (with the session's expiry)


async def test_a_turns_approval_requests_and_answers_leave_with_the_window_after_it(
    make_harness: Any, redis: Redis
) -> None:
    """Every request a turn made (with its tool's arguments) and its answer are kept while the
    turn runs or waits, and for the idempotency window after it ended (an answer repeated
    within it is the same answer); then they go, as the turn's message id does."""
    runs: list[tuple[str, dict[str, Any], str]] = []
    agent, _ = gated_agent(runs)
    h: Harness = await make_harness(agent, idempotency_ms=300)
    sid = await h.sessions.create("anon")
    keys = SessionKeys(sid)
    for n in range(3):
        turn = await h.sessions.submit_and_wait(sid, "anon", f"delete /f{n}", context=None, message_id=None, timeout=10)
        assert turn.status == "waiting"
        (rid,) = await h.sessions.pending(sid, "anon")
        await window_passed(redis, 300)  # (waiting longer than the window: still answerable)
        done = await h.sessions.respond_and_wait(sid, "anon", rid, "approve", timeout=10)
        assert done.status == "completed"
        again = await h.sessions.respond(sid, "anon", rid, "approve")  # the same answer again
        assert isinstance(again, AlreadyAnswered)
    assert [r[1]["path"] for r in runs] == ["/f0", "/f1", "/f2"]

    async def gone() -> bool:
        return not await redis.exists(keys.pending, keys.decisions)

    await eventually(gone, 5)
    with pytest.raises(NotFound):  # (long after: a request the session no longer knows)
        await h.sessions.respond(sid, "anon", rid, "approve")


def test_events_are_kept_at_least_as_long_as_message_ids() -> None:
    """A message sent again within its id's window is answered from its turn's events (a retried
    `?wait=true` says how its turn ended): a shorter event window is refused at start."""
    assert Settings.from_env({"KEEL_EVENT_RETENTION_HOURS": "48"}).event_retention_ms == 48 * 3_600_000
    assert Settings.from_env({"KEEL_EVENT_RETENTION_HOURS": "0.5", "KEEL_IDEMPOTENCY_HOURS": "0.25"})
    with pytest.raises(SettingsError, match="KEEL_EVENT_RETENTION_HOURS must be at least KEEL_IDEMPOTENCY_HOURS"):
        Settings.from_env({"KEEL_EVENT_RETENTION_HOURS": "1"})


async def test_a_turn_with_thousands_of_messages_steered_into_it_ends(redis: Redis) -> None:
    """The ids of the messages steered into a turn get their window as it ends, however many
    (Lua's `unpack` takes some 8,000 values at most: they go in slices). A final commit that
    failed there would have popped the inbox and written nothing else: the session broken."""
    store = Store(redis, idempotency_ms=60_000)
    await store.start()
    try:
        sid, begun = await running(store)
        n = 8_500
        for start in range(0, n, 500):
            steered = [
                InboxMessage(message_id=f"m-{k}", turn_id=f"turn_{k}", text="s") for k in range(start, start + 500)
            ]
            await asyncio.gather(*(store.submit(sid, "o", m, policy="steer") for m in steered))
        step = await store.commit(sid, begun.fence, "turn_head", [], [], attempt=True)
        assert len(step.steered) == n
        await store.commit(sid, begun.fence, "turn_head", [], [], mode="final")
        ttls = await redis.hpttl(SessionKeys(sid).mids, "m-head", "m-0", f"m-{n - 1}")
        assert all(0 < t <= 60_000 for t in ttls), ttls
        assert (await store.meta(sid, "o")).status == "idle"
    finally:
        await store.close()

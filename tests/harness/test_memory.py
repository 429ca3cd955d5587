"""Memory by design: a session keeps its events for `event_retention_ms` (then the outbox is
trimmed, and a session left alone keeps none), a message id for `idempotency_ms` (a repeat
within it is the same message, after it a new one), and in its history list only the active
history (what a compaction or a clear replaced leaves Redis); nothing a user is promised is lost
on the way: `history`, turns, the cache of history and forks go on as before."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from redis.asyncio import Redis

from harness import Agent, Harness
from harness.loop.compaction import Compaction
from harness.models import ModelReply, ModelRequest, ScriptedModel
from harness.store.keys import SessionKeys
from tests.channels.slack_support import eventually


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
    h: Harness = await make_harness(Agent(instructions="t", model=echo()), event_retention_ms=400)
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
    h: Harness = await make_harness(Agent(instructions="t", model=echo()), event_retention_ms=300)
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

"""Readers of a session in one process hear of commits made in another at once (found by
deploy/loadtest: a web process with KEEL_RUN_TURNS=0 and a worker, turns that showed up on the
websocket only at the next heartbeat, 15 s later)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import pytest

from harness import Agent
from harness.events import LiveEvent, StoredEvent, delta
from harness.models import ModelReply, ScriptedModel
from harness.store import bus
from harness.store.keys import SessionKeys
from tests.channels.slack_support import eventually
from tests.conftest import channel_client


async def types_until_turn_completed(reader: Any) -> list[str]:
    """The types of the committed events a tail gives, up to the next turn.completed (within
    5 s: well before its heartbeat)."""
    seen: list[str] = []
    async with asyncio.timeout(5):
        while not seen or seen[-1] != "turn.completed":
            event = await anext(reader)
            if isinstance(event, StoredEvent):
                seen.append(event.type)
    return seen


async def test_a_reader_gets_a_turn_run_elsewhere_though_its_own_event_came_with_the_notice(
    make_harness: Any,
) -> None:
    """The web process commits the message (its event handed to its readers directly); the
    worker runs the turn, whose commit notices reach the web process before its reader looks.
    The reader must not take the handed-over event for all there is: it reads the stream and
    gets the turn's events now, not after the heartbeat (60 s here)."""
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="hi")))
    await make_harness(agent)  # the worker
    web = await make_harness(agent, run_turns=False)
    sid = await web.sessions.create("anon")
    reader = web.sessions.tail(sid, "0", heartbeat=60.0)
    try:
        first = await anext(reader)
        assert isinstance(first, StoredEvent) and first.type == "session.created"
        # The reader does not look meanwhile (a busy event loop): the message's event is handed
        # to it, and the notices of the worker's commits arrive (they woke this waiter too).
        turn = await web.sessions.submit_and_wait(sid, "anon", "hello", context=None, message_id=None, timeout=10)
        assert turn.status == "completed"
        seen = await types_until_turn_completed(reader)
        assert seen[0] == "message.received" and seen[-1] == "turn.completed"
    finally:
        await reader.aclose()  # type: ignore[attr-defined]


async def spied(redis: Any, channel: str, turn: Any) -> list[bytes]:
    """What is published on `channel` while `turn()` runs: the messages heard before a marker
    the test publishes after it (pub/sub keeps a publisher's order, so nothing is left out)."""
    async with channel_client(redis, channel) as client:
        spy = client.pubsub()
        await spy.ssubscribe(channel)
        try:
            async with asyncio.timeout(5):  # (the confirmation)
                while (await spy.get_message(timeout=1)) is None:
                    pass
            await turn()
            await client.execute_command("SPUBLISH", channel, b"marker")
            heard: list[bytes] = []
            async with asyncio.timeout(5):
                while not heard or heard[-1] != b"marker":
                    message = await spy.get_message(timeout=1)
                    if message is not None and message["type"] == "smessage":
                        heard.append(message["data"])
            return heard[:-1]
        finally:
            await spy.aclose()


async def test_commit_notices_are_published_only_for_readers_in_another_process(make_harness: Any, redis: Any) -> None:
    """A process whose readers only hear its own commits gets them from its hub: its scripts
    publish no notice (nor does it hear and parse them back). Once another process has a reader
    of the session, the same turns' notices reach it, and its reader gets them at once (not at
    its heartbeat, 60 s here)."""
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="hi")))
    worker = await make_harness(agent)
    sid = await worker.sessions.create("anon")
    channel = SessionKeys(sid).live

    async def turn() -> None:
        res = await worker.sessions.submit_and_wait(sid, "anon", "hello", context=None, message_id=None, timeout=10)
        assert res.status == "completed"

    assert await spied(redis, channel, turn) == []  # its own waiter only: nobody else to tell

    web = await make_harness(agent, run_turns=False)
    reader = web.sessions.tail(sid, "0", heartbeat=60.0)
    try:
        while (await anext(reader)).type != "turn.completed":  # the first turn's events, read
            pass
        await eventually(lambda: redis.hexists(SessionKeys(sid).readers, web.store.origin), 5)
        heard = await spied(redis, channel, turn)
        assert heard and all(m.startswith(b"@") for m in heard), heard  # the commits' notices
        seen = await types_until_turn_completed(reader)
        assert seen[0] == "message.received"
    finally:
        await reader.aclose()  # type: ignore[attr-defined]


async def test_a_reader_gets_the_events_in_the_order_they_came_live_and_committed(make_harness: Any) -> None:
    """A turn begun by the message's own SUBMIT streams at once, before the reader is back: the
    reader still sends message.received and turn.started before the reply's first delta, and
    the deltas before the message.completed that ends them."""
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="a reply in parts"), chunk=3))
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    reader = h.sessions.tail(sid, "0", heartbeat=60.0)
    try:
        assert (await anext(reader)).type == "session.created"
        await h.sessions.submit(sid, "anon", "hello")
        seen: list[str] = []
        async with asyncio.timeout(5):
            while not seen or seen[-1] != "turn.completed":
                event = await anext(reader)
                if event is not None:
                    seen.append(event.type)
        first_delta = seen.index("message.delta")
        assert seen[:first_delta] == ["message.received", "turn.started"], seen
        assert seen.index("message.completed") > first_delta
    finally:
        await reader.aclose()  # type: ignore[attr-defined]


async def streamed(hub: Any, sid: str, offsets: Iterable[int]) -> None:
    """A turn's live events as a model streams them: one a flush (the offsets, a character each)."""
    for n in offsets:
        hub.live(sid, delta(sid, "turn_1", "it_1", "x", n))
        await hub.flush_live()


async def test_live_events_go_out_only_while_another_process_reads_the_session(
    make_harness: Any, redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn's live events (message.delta) reach other processes' readers through pub/sub, and
    are published unless a recent look at the session's readers (made in a flush, again once
    LIVE_LOOK_S has passed) found no other process. With nobody elsewhere, only the first event
    (sent with the first look) goes to Redis. Once the look is old, the events go again (a
    reader may have been named since: a later turn's reader gets the reply from its start)."""
    monkeypatch.setattr(bus, "LIVE_LOOK_S", 60.0)
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="hi")))
    worker = await make_harness(agent, run_turns=False)
    sid = await worker.sessions.create("anon")
    hub = worker.store.hub

    async def alone() -> None:
        await streamed(hub, sid, range(4))

    heard = await spied(redis, SessionKeys(sid).live, alone)
    assert len(heard) == 1 and b'"offset":0' in heard[0], heard  # (sent with the first look only)

    web = await make_harness(agent, run_turns=False)
    reader = web.sessions.tail(sid, "0", heartbeat=60.0)
    try:
        assert (await anext(reader)).type == "session.created"
        await eventually(lambda: redis.hexists(SessionKeys(sid).readers, web.store.origin), 5)
        monkeypatch.setattr(bus, "LIVE_LOOK_S", 0.0)  # (the look that found nobody is old now)
        await streamed(hub, sid, (4, 5))
        got: list[bytes] = []
        async with asyncio.timeout(5):
            while len(got) < 2:
                event = await anext(reader)
                if isinstance(event, LiveEvent):
                    got.append(event.raw)
        assert b'"offset":4' in got[0] and b'"offset":5' in got[1], got
    finally:
        await reader.aclose()  # type: ignore[attr-defined]


async def test_a_reader_named_long_past_its_deadline_does_not_count_for_live_events(
    make_harness: Any, redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process still named in a session's readers long after its deadline (it died: nothing
    renews its name, though the key lives on) is not a reader for live events; one within its
    deadline is."""
    monkeypatch.setattr(bus, "LIVE_LOOK_S", 60.0)
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="hi")))
    worker = await make_harness(agent, run_turns=False)
    hub, now_ms = worker.store.hub, int(time.time() * 1000)

    async def published(reader_until_ms: int) -> int:
        sid = await worker.sessions.create("anon")
        await redis.hset(SessionKeys(sid).readers, "elsewhere", reader_until_ms)
        return len(await spied(redis, SessionKeys(sid).live, lambda: streamed(hub, sid, range(3))))

    assert await published(now_ms - 3_600_000) == 1  # (the first, sent with the first look)
    assert await published(now_ms + 60_000) == 3


async def test_a_reader_named_elsewhere_before_a_reply_streams_gets_all_of_it(
    make_harness: Any, redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look at the session's readers that found nobody stands for LIVE_LOOK_S, but not into
    the next model call: a reader another process opened (and was named for) before a reply
    begins to stream gets every one of its deltas, however recent that look."""
    monkeypatch.setattr(bus, "LIVE_LOOK_S", 60.0)
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="abcdef"), chunk=2))
    worker = await make_harness(agent)
    sid = await worker.sessions.create("anon")
    first = await worker.sessions.submit_and_wait(sid, "anon", "one", context=None, message_id=None, timeout=5)
    assert first.status == "completed"  # (streamed with nobody elsewhere: the look found none)
    web = await make_harness(agent, run_turns=False)
    reader = web.sessions.tail(sid, "0", heartbeat=60.0)
    try:
        await types_until_turn_completed(reader)  # (the first turn, replayed)
        await eventually(lambda: redis.hexists(SessionKeys(sid).readers, web.store.origin), 5)
        await worker.sessions.submit(sid, "anon", "two")
        deltas: list[bytes] = []
        async with asyncio.timeout(5):
            while True:
                event = await anext(reader)
                if isinstance(event, LiveEvent):
                    deltas.append(event.raw)
                elif isinstance(event, StoredEvent) and event.type == "turn.completed":
                    break
        assert [b'"offset":%d' % n in d for n, d in zip((0, 2, 4), deltas, strict=True)] == [True] * 3, deltas
    finally:
        await reader.aclose()  # type: ignore[attr-defined]

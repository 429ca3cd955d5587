"""`KEEL_DURABILITY=replica` on one primary with one replica: a reader of a session's events is
shown only what a replica has (a failover could lose the rest, and a client must never have seen
an event that is then gone), and other processes hear of a commit only once a replica has it.
The replica is held back by stopping it (SIGSTOP): the primary's WAIT then gets no answer."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from harness.errors import Unavailable
from harness.events import MessageReceived, SessionCreated
from harness.store import Store, new_subscription
from harness.store.hooks import SUBS
from harness.store.keys import RELAY_JOBS, SessionKeys, dead_letters
from harness.store.wire import NotReplicated
from harness.types import InboxMessage
from tests.conftest import ON_CLUSTER, ValkeyServer

pytestmark = pytest.mark.skipif(ON_CLUSTER, reason="a primary and replica of its own (once per `make test`)")

WAIT_MS = 400  # how long a write waits for the replica here


class Pair:
    def __init__(self) -> None:
        self.primary = ValkeyServer()
        self.replica = ValkeyServer()

    def stop_replica(self) -> None:
        assert self.replica.proc is not None
        self.replica.proc.send_signal(signal.SIGSTOP)

    def resume_replica(self) -> None:
        assert self.replica.proc is not None
        self.replica.proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    p.primary.start()
    p.replica.start()
    yield p
    p.resume_replica()
    p.replica.remove()
    p.primary.remove()


async def caught_up(primary: Redis, replica: Redis) -> None:
    """Until the replica has everything the primary has (Redis announces no event for it: the
    offsets are polled, within a timeout)."""
    async with asyncio.timeout(10):
        while True:
            mine = (await primary.info("replication"))["master_repl_offset"]
            theirs = await replica.info("replication")
            if theirs.get("master_link_status") == "up" and theirs.get("slave_repl_offset") == mine:
                return
            await asyncio.sleep(0.01)


@pytest.fixture
async def linked(pair: Pair) -> AsyncIterator[tuple[Redis, Redis]]:
    primary, replica = Redis.from_url(pair.primary.url), Redis.from_url(pair.replica.url)
    await primary.flushall()
    await replica.replicaof("127.0.0.1", pair.primary.port)
    await caught_up(primary, replica)
    yield primary, replica
    pair.resume_replica()
    await primary.aclose()
    await replica.aclose()


async def stream_length(redis: Redis, sid: str, n: int) -> None:
    """Until the session's outbox holds `n` events (on the primary; polled, within a timeout)."""
    async with asyncio.timeout(5):
        while await redis.xlen(SessionKeys(sid).outbox) < n:  # noqa: ASYNC110
            await asyncio.sleep(0.005)


def message(n: int) -> InboxMessage:
    return InboxMessage(message_id=f"m{n}", turn_id=f"turn_{n}", text=f"hello {n}")


async def test_a_reader_is_shown_no_event_before_a_replica_has_it(pair: Pair, linked: tuple[Redis, Redis]) -> None:
    primary, replica = linked
    store = Store(primary, replicas=1, replica_wait_ms=WAIT_MS)
    await store.start()
    try:
        await store.create("ses_r1", "o", {})
        assert [e.type for e in await store.outbox.events("ses_r1")] == [SessionCreated.TYPE]

        pair.stop_replica()
        writing = asyncio.create_task(store.submit("ses_r1", "o", message(1)))
        await stream_length(primary, "ses_r1", 2)  # on the primary, the write waits in WAIT
        # a reader now (the SSE route's read, a resume's look back) is not shown it
        assert [e.type for e in await store.outbox.events("ses_r1")] == [SessionCreated.TYPE]
        assert await store.outbox.turn_begins("ses_r1", "turn_1") is None
        # (a look that shows nothing, whether a request's event is there to be read, finds it)
        anything = await store.outbox.find_back("ses_r1", (MessageReceived.TYPE,), lambda *_: True, unshown=True)
        assert anything is not None and anything.type == MessageReceived.TYPE
        created = (await store.outbox.events("ses_r1"))[0].id
        assert await store.outbox.newest("ses_r1") == created  # (where a replay is caught up)
        with pytest.raises(Unavailable) as failed:
            await writing  # the replica never answered: not acknowledged either
        assert isinstance(failed.value.__cause__, NotReplicated)
        assert [e.type for e in await store.outbox.events("ses_r1")] == [SessionCreated.TYPE]

        pair.resume_replica()
        await caught_up(primary, replica)
        # the same message sent again (what a client does after a 503): the replica has it now
        again = await store.submit("ses_r1", "o", message(1))
        shown = await store.outbox.events("ses_r1")
        assert [e.type for e in shown] == [SessionCreated.TYPE, MessageReceived.TYPE]
        assert shown[1].id == again.received_id
        assert await store.outbox.turn_begins("ses_r1", "turn_1") == again.received_id
        assert await store.outbox.newest("ses_r1") == again.received_id
    finally:
        await store.close()


async def test_other_processes_hear_of_a_commit_only_once_a_replica_has_it(
    pair: Pair, linked: tuple[Redis, Redis]
) -> None:
    primary, replica = linked
    store = Store(primary, replicas=1, replica_wait_ms=WAIT_MS)
    await store.start()
    listener = primary.pubsub()
    live = SessionKeys("ses_r2").live
    try:
        await store.create("ses_r2", "o", {})
        await listener.execute_command("SSUBSCRIBE", live)
        pair.stop_replica()
        with pytest.raises(Unavailable):
            await store.submit("ses_r2", "o", message(1))
        await primary.execute_command("SPUBLISH", live, "end of the failed write")
        heard = await notices_until(listener, b"end of the failed write")
        assert heard == [], "a commit no replica has was announced"

        pair.resume_replica()
        await caught_up(primary, replica)
        again = await store.submit("ses_r2", "o", message(1))
        await primary.execute_command("SPUBLISH", live, "end of the second")
        assert await notices_until(listener, b"end of the second") == [b"@" + again.received_id.encode()]
    finally:
        await listener.aclose()
        await store.close()


async def notices_until(listener: object, sentinel: bytes) -> list[bytes]:
    """The commit notices (`@<id>`) the listener gets before `sentinel`."""
    got: list[bytes] = []
    async with asyncio.timeout(5):
        while True:
            msg = await listener.get_message(ignore_subscribe_messages=True, timeout=1.0)  # type: ignore[attr-defined]
            if msg is None:
                continue
            if msg["data"] == sentinel:
                return got
            if msg["data"].startswith(b"@"):
                got.append(msg["data"])


async def test_a_mark_lost_in_a_failover_is_made_again_by_a_reader(pair: Pair, linked: tuple[Redis, Redis]) -> None:
    """A primary that dies just after a write's mark (its events on the replica, the mark not):
    the promoted replica would hide them until the session's next write. A reader shown less
    than the stream holds looks again soon (within twice the WAIT time, not at its heartbeat) and
    marks what a replica has."""
    primary, _ = linked
    store = Store(primary, replicas=1, replica_wait_ms=WAIT_MS)
    await store.start()
    try:
        await store.create("ses_r3", "o", {})
        await store.submit("ses_r3", "o", message(1))
        meta = SessionKeys("ses_r3").meta
        created = (await store.outbox.events("ses_r3"))[0]
        await primary.hset(meta, "replicated", created.id)  # the mark as the promoted replica has it
        assert [e.type for e in await store.outbox.events("ses_r3")] == [SessionCreated.TYPE]
        reading = store.outbox.tail("ses_r3", created.id, heartbeat=60)
        async with asyncio.timeout(5):
            got = None
            while got is None:  # (a keep-alive, then the look shows the event)
                got = await anext(reading)
        assert got.type == MessageReceived.TYPE
        await reading.aclose()
    finally:
        await store.close()


async def test_a_job_is_acknowledged_only_once_a_replica_has_it(pair: Pair, linked: tuple[Redis, Redis]) -> None:
    """The job that wakes a session for an answer or a cancel goes after the write it stands
    for. Acknowledged before a replica had it, a failover could take the job back and keep the
    answer: the turn then waits for a job forever (the failover soak saw it: an answer accepted,
    the session `running` and never resumed). Relay jobs likewise."""
    primary, replica = linked
    store = Store(primary, replicas=1, replica_wait_ms=WAIT_MS)
    await store.start()
    try:
        await store.create("ses_r4", "o", {})
        pair.stop_replica()
        with pytest.raises(Unavailable) as failed:
            await store.add_job("ses_r4")
        assert isinstance(failed.value.__cause__, NotReplicated)
        with pytest.raises(Unavailable):
            await store.add_relay_jobs("ses_r4", ["hook_1"])

        pair.resume_replica()
        await caught_up(primary, replica)
        job = await store.add_job("ses_r4")
        # acknowledged: the replica has it already (a failover now keeps it)
        assert await replica.xrange(store.jobs.of("ses_r4").stream, str(job), str(job)) != []
    finally:
        await store.close()


async def test_a_subscription_and_a_dead_letter_wait_for_a_replica(pair: Pair, linked: tuple[Redis, Redis]) -> None:
    """A webhook subscription answered 201 and then lost in a failover would never deliver; a
    dead letter lost so, its event's cursor moved past it, would be neither delivered nor
    listed. Both are acknowledged only once a replica has them."""
    primary, replica = linked
    store = Store(primary, replicas=1, replica_wait_ms=WAIT_MS)
    await store.start()
    sub = new_subscription("wh_r5", "o", url="https://example.com/h", events=["*"], secret="s", description="")
    try:
        pair.stop_replica()
        with pytest.raises(Unavailable):
            await store.hooks.add(sub)
        with pytest.raises(Unavailable):
            await store.deliveries.bury("ses_r5", "1-0", "wh:wh_r5", "refused", 3)

        pair.resume_replica()
        await caught_up(primary, replica)
        await store.hooks.add(sub)
        await primary.xadd(SessionKeys("ses_r5").outbox, {"t": "session.created"}, id="1-0")  # (still kept)
        await store.deliveries.bury("ses_r5", "1-0", "wh:wh_r5", "refused", 3)
        # acknowledged: the replica has them already
        assert await replica.hget(SUBS, "wh_r5") is not None
        assert await replica.hget(dead_letters("wh:wh_r5"), "ses_r5 1-0") is not None
        assert await store.deliveries.retry("wh:wh_r5") == 1
        assert await replica.hlen(dead_letters("wh:wh_r5")) == 0 and await replica.xlen(RELAY_JOBS) == 1
        assert await store.hooks.remove("o", "wh_r5")
        assert await replica.hget(SUBS, "wh_r5") is None
    finally:
        await store.close()


async def test_a_history_read_waits_for_no_replica(pair: Pair, linked: tuple[Redis, Redis]) -> None:
    """A page of history (and a fork's read) is read by a script that writes nothing: it is not
    held up by a replica that lags, as the writes are (each waits for the replica)."""
    primary, _ = linked
    store = Store(primary, replicas=1, replica_wait_ms=WAIT_MS)
    await store.start()
    try:
        await store.create("ses_r9", "o", {})
        pair.stop_replica()
        with pytest.raises(Unavailable):  # (a write the replica never answered, on the pooled link)
            await store.submit("ses_r9", "o", message(1))
        async with asyncio.timeout(WAIT_MS / 1000 / 2):  # (a WAIT would take WAIT_MS, then fail)
            assert await store.history_page("ses_r9", "o") == (0, [])
    finally:
        pair.resume_replica()
        await store.close()

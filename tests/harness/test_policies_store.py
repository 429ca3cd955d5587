"""Message policies and forks at the store, where the order of a session's inbox and its events
can be read directly: interrupts run in the order they were sent, before messages steered into
the turn they end (which run next, in the order they came, their events in that order too); a
fork before a message whose turn compacted the history keeps the summary (what came before the
message), and the copied messages' ids are the fork's."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from redis.asyncio import Redis

from harness.events import MessageReceived, TurnCompletedData, pending
from harness.ids import new_id
from harness.store import Begun, Store
from harness.store.keys import SessionKeys
from harness.types import InboxMessage, Item

_inbox = msgspec.json.Decoder(InboxMessage)


def message(name: str) -> InboxMessage:
    return InboxMessage(message_id=f"m-{name}", turn_id=f"turn_{name}", text=name)


async def inbox(redis: Redis, sid: str) -> list[str]:
    return [_inbox.decode(raw).text for raw in await redis.lrange(SessionKeys(sid).inbox, 0, -1)]


async def started(stores: Callable[[], Store]) -> tuple[Store, str, Begun]:
    store = stores()
    await store.start()
    sid = new_id("ses")
    await store.create(sid, "o", {})
    await store.submit(sid, "o", message("head"))
    begun = await store.begin(sid, "", 60_000)
    assert isinstance(begun, Begun)
    return store, sid, begun


async def test_interrupts_run_in_order_before_steered_messages(stores: Callable[[], Store], redis: Redis) -> None:
    store, sid, begun = await started(stores)
    for name in ("s1", "s2"):
        assert (await store.submit(sid, "o", message(name), policy="steer")).steered
    for name in ("i1", "i2"):
        assert (await store.submit(sid, "o", message(name), policy="interrupt")).interrupted == "turn_head"
    await store.submit(sid, "o", message("q"))
    assert await inbox(redis, sid) == ["head", "i1", "i2", "q"]
    done = pending("turn_head", TurnCompletedData("m-head", "cancelled, say"))
    ended = await store.commit(sid, begun.fence, "turn_head", [], [done], mode="final")
    # the interrupts first, in the order sent; then the steered ones, in the order they came
    assert await inbox(redis, sid) == ["i1", "i2", "s1", "s2", "q"]
    received = [e for e in ended.events if e.type == MessageReceived.TYPE]
    assert [e.decoded().data.message_id for e in received] == ["m-s1", "m-s2"]  # type: ignore[attr-defined]
    assert received[0].seq < received[1].seq
    assert await store.received(sid, "m-s1") == ("turn_s1", received[0].id)


async def test_a_reject_sent_again_is_the_same_message(stores: Callable[[], Store], redis: Redis) -> None:
    store = stores()
    await store.start()
    sid = new_id("ses")
    await store.create(sid, "o", {})
    first = await store.submit(sid, "o", message("r"), policy="reject")  # nothing runs: it starts
    again = await store.submit(sid, "o", message("r"), policy="reject")  # its own turn is what runs now
    assert again.duplicate and again.received_id == first.received_id


async def test_a_fork_before_a_turn_that_compacted_keeps_the_summary(stores: Callable[[], Store]) -> None:
    store, sid, begun = await started(stores)
    summary = Item(id="sum", role="user", text="[summary] earlier", kind="summary", turn_id="turn_head")
    user = Item(id="it_turn_head_u", role="user", text="head", turn_id="turn_head", message_id="m-head")
    reply = Item(id="r1", role="assistant", text="ok", turn_id="turn_head")
    await store.commit(sid, begun.fence, "turn_head", [summary, user, reply], [], mode="final", rebase=1)
    fork = new_id("ses")
    await store.fork(sid, "o", fork, "m-head")
    assert [i.id for i in await store.history(fork, "o")] == ["sum"]  # what came before the message
    whole = new_id("ses")
    await store.fork(sid, "o", whole)
    assert [i.id for i in await store.history(whole, "o")] == ["sum", "it_turn_head_u", "r1"]
    # the copied message's id is the fork's: sent again, it is the same message
    assert (await store.submit(whole, "o", message("head"))).duplicate

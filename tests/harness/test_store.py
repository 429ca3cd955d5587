"""The store's edge: Redis failures leave it as `Unavailable`; what a script writes is what Python
encoded (no JSON cut or spliced); a rebase of any length commits."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from harness import Agent, tool
from harness.errors import Unavailable
from harness.events import StoredEvent
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from harness.store import Begun, Store, connect
from harness.types import InboxMessage, Item
from tests.conftest import free_port
from tests.events import env


def idle_agent() -> Agent:
    return Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="x")))


async def test_a_redis_that_does_not_answer_is_unavailable_never_a_redis_error() -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}")  # nothing listens there
    store = Store(client)
    message = InboxMessage(message_id="m1", turn_id="turn_1", text="hi")
    calls: list[Any] = [
        store.ping(),
        store.create("ses_x", "o", {}),
        store.submit("ses_x", "o", message),
        store.begin("ses_x", "", 5_000),
        store.outbox.events("ses_x", "0-0"),
        store.outbox.newest("ses_x"),
        store.meta("ses_x", "o"),
        store.add_job("ses_x"),
    ]
    for call in calls:
        with pytest.raises(Unavailable) as raised:
            await call
        assert raised.value.code == "unavailable"
        assert isinstance(raised.value.__cause__, RedisError | OSError)
    await store.close()
    await client.aclose()


async def test_the_inbox_holds_the_message_as_python_encoded_it(make_harness: Any, redis: Redis) -> None:
    h = await make_harness(idle_agent(), run_turns=False)
    sid = await h.sessions.create("o")
    res = await h.sessions.submit(sid, "o", 'quote " brace } and é', {"page": "/p/1", "gone": None}, message_id="m-1")
    (raw,) = await redis.lrange(f"keel:{{{sid}}}:inbox", 0, -1)
    entry = msgspec.json.decode(raw, type=InboxMessage)
    assert raw == msgspec.json.encode(entry)  # stored byte for byte, nothing spliced in
    assert (entry.message_id, entry.turn_id, entry.text) == ("m-1", res.turn_id, 'quote " brace } and é')
    again = await h.sessions.submit(sid, "o", "other text", message_id="m-1")  # the idempotency record names the first
    assert (again.duplicate, again.turn_id, again.received_id) == (True, res.turn_id, res.received_id)


async def test_a_rebase_longer_than_luas_unpack_limit_commits(make_harness: Any) -> None:
    h = await make_harness(idle_agent(), run_turns=False)
    sid = await h.sessions.create("o")
    await h.sessions.submit(sid, "o", "hi")
    begun = await h.store.begin(sid, "", 5_000)
    assert isinstance(begun, Begun)
    items = [Item(id=f"it_{n}", role="user", text=f"item {n}") for n in range(9_000)]
    await h.store.commit(sid, begun.fence, begun.message.turn_id, items, [], rebase=len(items))
    history = await h.sessions.history(sid, "o")
    assert [i.id for i in history] == [i.id for i in items]


async def test_a_cancelled_pause_withdraws_its_requests_in_the_order_they_were_made(make_harness: Any) -> None:
    @tool(approval=True)
    def delete(path: str) -> str:
        """Delete a file."""
        return f"deleted {path}"

    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "user":
            return ModelReply(tool_calls=[ToolCall("delete", {"path": f"/{n}"}) for n in range(6)])
        return ModelReply(text="ok")

    h = await make_harness(Agent(instructions="t", tools=[delete], model=ScriptedModel(script)))
    sid = await h.sessions.create("o")
    submitted = await h.sessions.submit(sid, "o", "delete them")
    turn = await h.sessions.wait_turn(submitted, 10)
    asked = [q["request_id"] for q in env(turn.events[-1])["data"]["requests"]]
    assert turn.status == "waiting" and len(asked) == 6
    await h.sessions.cancel(sid, "o")
    withdrawn = []
    async with asyncio.timeout(10):
        async for event in h.sessions.tail(sid, "0-0", heartbeat=1.0):
            if isinstance(event, StoredEvent) and event.type == "input.resolved":
                withdrawn.append(msgspec.json.decode(event.raw)["data"]["request_id"])
            if isinstance(event, StoredEvent) and event.type == "turn.cancelled":
                break
    assert withdrawn == asked


async def test_a_cancels_request_id_never_passes_for_a_message_id(make_harness: Any) -> None:
    """A channel's cancel is kept under its request's id so a redelivery changes nothing; a
    message whose id is that same string is still a new message (it was a 500: the cancel's
    mark was read as the message's first delivery)."""
    h = await make_harness(Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="ok"))))
    sid = await h.sessions.create("anon")
    await h.store.cancel(sid, "anon", once="act-1")
    sent = await h.sessions.submit(sid, "anon", "hello", message_id="act-1")
    assert not sent.duplicate
    turn = await h.sessions.wait_turn(sent, 10)
    assert turn.status == "completed" and turn.reply == "ok"
    again = await h.store.cancel(sid, "anon", once="act-1")  # (the redelivered cancel: nothing to do)
    assert type(again).__name__ == "NothingToCancel"

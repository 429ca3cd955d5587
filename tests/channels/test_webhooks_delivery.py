"""Outbound event webhooks, the deliveries: every subscribed event of the key's sessions, signed
(verified with `standardwebhooks`), the body byte for byte the SSE envelope, the same webhook-id
on every retry, in order per session, at least once; a failing or slow receiver holds up only
its own deliveries; 410 disables; failures dead-lettered, listed and retried."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from channels.webhooks.addresses import PublicResolver
from harness.store import streamids
from harness.store.keys import SessionKeys
from tests.channels.slack_support import echo_agent, eventually, relay_done
from tests.channels.webhook_receiver import Delivery, Receiver

pytestmark = pytest.mark.asyncio


async def subscribe(c: httpx.AsyncClient, receiver: Receiver, path: str, events: list[str], **behaviour: Any) -> str:
    r = await c.post("/v1/webhooks", json={"url": receiver.url(path), "events": events})
    assert r.status_code == 201, r.text
    receiver.expect(path, r.json()["secret"], **behaviour)
    return str(r.json()["id"])


async def sse_bodies(c: httpx.AsyncClient, sid: str, turns: int) -> list[bytes]:
    """The session's committed events as SSE sends them (the `data:` bytes), up to the end of
    its `turns`-th turn."""
    bodies: list[bytes] = []
    async with c.stream("GET", f"/v1/sessions/{sid}/events?after=0-0") as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                bodies.append(line[6:].encode())
                if sum(b'"type":"turn.completed"' in b for b in bodies) == turns:
                    break
    return bodies


def ids_in_order(deliveries: list[Delivery]) -> list[str]:
    """Webhook ids in the order each was first delivered."""
    return list(dict.fromkeys(d.webhook_id for d in deliveries))


async def turns(c: httpx.AsyncClient, *texts: str) -> str:
    sid = str((await c.post("/v1/sessions")).json()["session_id"])
    for text in texts:
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": text})
        assert r.json()["status"] == "completed"
    return sid


async def test_every_subscribed_event_is_delivered_signed_and_byte_for_byte(serve: Any, receiver: Receiver) -> None:
    live = await serve(echo_agent(), api_keys=("k1", "k2"), webhook_allow_private=True)
    async with live.client("k1") as c1, live.client("k2") as c2:
        await subscribe(c1, receiver, "all", ["*"])
        await subscribe(c1, receiver, "done", ["turn.completed"])
        await subscribe(c2, receiver, "other", ["*"])
        sid = await turns(c1, "one", "two")
        sse = await sse_bodies(c1, sid, 2)
        await receiver.until(lambda r: len(ids_in_order(r.delivered("all"))) >= len(sse))
        await receiver.until(lambda r: len(ids_in_order(r.delivered("done"))) == 2)
        bodies = {d.webhook_id: d.body for d in receiver.delivered("all")}
        assert [bodies[i] for i in ids_in_order(receiver.delivered("all"))] == sse  # session.created first
        assert all(i.startswith(f"{sid}:") for i in bodies)
        assert all(b'"type":"turn.completed"' in d.body for d in receiver.delivered("done"))
        assert receiver.attempts("other") == [] and receiver.invalid == 0


async def test_a_flaky_receiver_gets_everything_in_order_with_stable_ids(serve: Any, receiver: Receiver) -> None:
    live = await serve(echo_agent(), api_keys=("k1",), webhook_allow_private=True)
    async with live.client("k1") as c:
        # half the events' first requests get a 500 (per event, not per request: with every other
        # request failing, one session's retries could keep landing on the failing turn, each
        # waiting twice as long as the last)
        await subscribe(c, receiver, "flaky", ["*"], fail_once_every=2)
        sessions = [await turns(c, "a", "b") for _ in range(3)]
        expected = {sid: await sse_bodies(c, sid, 2) for sid in sessions}
        total = sum(len(v) for v in expected.values())
        await receiver.until(lambda r: len(ids_in_order(r.delivered("flaky"))) >= total, timeout=60)
        failed = [d for d in receiver.attempts("flaky") if d.status == 500]
        assert len(failed) == total // 2 and all(
            d.webhook_id in {x.webhook_id for x in receiver.delivered("flaky")} for d in failed
        )
        for sid, bodies in expected.items():
            mine = [d for d in receiver.delivered("flaky") if d.webhook_id.startswith(f"{sid}:")]
            got = {d.webhook_id: d.body for d in mine}
            assert [got[i] for i in ids_in_order(mine)] == bodies  # every event, in session order


async def test_a_slow_receiver_holds_up_only_its_own_deliveries(serve: Any, receiver: Receiver) -> None:
    live = await serve(echo_agent(), api_keys=("k1",), webhook_allow_private=True, webhook_timeout=1.0)
    async with live.client("k1") as c:
        await subscribe(c, receiver, "slow", ["turn.completed"], slow_first=2, slow_s=30.0)
        await subscribe(c, receiver, "quick", ["turn.completed"])
        sessions = [await turns(c, "x") for _ in range(3)]
        await receiver.until(lambda r: len(r.delivered("quick")) == 3, timeout=10)
        assert len(ids_in_order(receiver.delivered("slow"))) < 3  # still waiting on the slow one
        await receiver.until(lambda r: len(ids_in_order(r.delivered("slow"))) == 3, timeout=40)
        assert {i.split(":")[0] for i in ids_in_order(receiver.delivered("slow"))} == set(sessions)


async def test_410_disables_the_webhook(serve: Any, receiver: Receiver, redis: Redis) -> None:
    live = await serve(echo_agent(), api_keys=("k1",), webhook_allow_private=True)
    async with live.client("k1") as c:
        wid = await subscribe(c, receiver, "gone", ["turn.completed"], gone=True)
        await turns(c, "x")
        await receiver.until(lambda r: len(r.attempts("gone")) == 1)
        shown = (await c.get(f"/v1/webhooks/{wid}")).json()
        assert "410" in shown["disabled"]
        await turns(c, "y")
        await relay_done(redis)  # the relay is through with the second turn: nothing sent
        assert len(receiver.attempts("gone")) == 1


async def test_failures_past_the_retry_window_are_listed_and_retried(serve: Any, receiver: Receiver) -> None:
    live = await serve(echo_agent(), api_keys=("k1",), webhook_allow_private=True, webhook_retry_hours=0.001)
    async with live.client("k1") as c:
        wid = await subscribe(c, receiver, "down", ["turn.completed"], fail_every=1)  # every request fails
        sid = await turns(c, "x")
        failures: list[Any] = []

        async def listed() -> bool:
            failures[:] = (await c.get(f"/v1/webhooks/{wid}/failures")).json()["failures"]
            return bool(failures)

        await eventually(listed, 30)
        assert failures[0]["session_id"] == sid and "500" in failures[0]["error"]
        receiver.paths["down"].fail_every = 0  # the receiver is back
        r = await c.post(f"/v1/webhooks/{wid}/failures/retry")
        assert r.status_code == 202 and r.json() == {"retried": 1}
        await receiver.until(lambda r: len(r.delivered("down")) == 1)
        assert (await c.get(f"/v1/webhooks/{wid}/failures")).json() == {"failures": []}


async def test_deliveries_never_connect_to_a_private_address() -> None:
    resolver = PublicResolver(allow_private=False)
    for host in ("localhost", "127.0.0.1", "10.0.0.1", "169.254.169.254"):
        with pytest.raises(OSError, match="not a public address"):
            await resolver.resolve(host, 443)
    assert await PublicResolver(allow_private=True).resolve("127.0.0.1", 443)


async def test_a_long_retry_after_gives_the_relay_slot_back_and_resumes(
    serve: Any, receiver: Receiver, redis: Redis
) -> None:
    live = await serve(echo_agent(), api_keys=("k1",), webhook_allow_private=True)
    async with live.client("k1") as c:
        await subscribe(c, receiver, "busy", ["turn.completed"], busy_first=1, busy_after="6")
        sid = await turns(c, "x", "y")
        await receiver.until(lambda r: len(r.attempts("busy")) == 1)

        async def parked() -> bool:
            return (
                int(await redis.zcard("keel:{relay}:later")) == 1 and int(await redis.xlen("keel:{relay}:stream")) == 0
            )

        await eventually(parked, 5)  # waiting without a job in hand: no relay slot held
        await receiver.until(lambda r: len(r.delivered("busy")) == 2, timeout=20)
        first, second = receiver.delivered("busy")
        assert first.webhook_id == receiver.attempts("busy")[0].webhook_id  # the same id, tried again
        assert first.webhook_id.startswith(f"{sid}:") and b'"turn.completed"' in first.body
        assert second.at - receiver.attempts("busy")[0].at >= 6.0  # Retry-After honoured


async def test_a_failure_retried_after_its_event_left_the_outbox_stays_listed_until_cleared(
    serve: Any, receiver: Receiver, redis: Redis
) -> None:
    """The retry of a failure whose event has since left the outbox has nothing to deliver: the
    failure stays listed, its first error kept and saying so (it was removed unsaid), and the
    next retry clears it."""
    live = await serve(
        echo_agent(),
        api_keys=("k1",),
        webhook_allow_private=True,
        webhook_retry_hours=0.0002,  # (0.7 s of tries, then a failure)
        event_retention_ms=4000,  # (longer: the event is listed as failed, not lost)
        idempotency_ms=4000,
    )
    async with live.client("k1") as c:
        wid = await subscribe(c, receiver, "down", ["turn.completed"], fail_every=1)
        sid = await turns(c, "one")

        async def failed() -> list[Any]:
            return list((await c.get(f"/v1/webhooks/{wid}/failures")).json()["failures"])

        await eventually(failed, 20)
        (letter,) = await failed()
        assert letter["lost"] == 0 and letter["session_id"] == sid

        async def outbox_gone() -> bool:
            return not await redis.exists(SessionKeys(sid).outbox)

        await eventually(outbox_gone, 10)
        receiver.paths["down"].fail_every = 0  # the endpoint is back, the event is not
        assert (await c.post(f"/v1/webhooks/{wid}/failures/retry")).json() == {"retried": 0}
        await relay_done(redis)
        (again,) = await failed()
        assert again["event_id"] == letter["event_id"] and again["error"].startswith(letter["error"][:100])
        assert "left the outbox" in again["error"], again
        assert not receiver.delivered("down")
        assert (await c.post(f"/v1/webhooks/{wid}/failures/retry")).json() == {"retried": 0}
        assert await failed() == []


async def test_events_that_leave_the_outbox_before_delivery_are_listed_as_lost(
    serve: Any, receiver: Receiver, redis: Redis
) -> None:
    """An endpoint down for longer than the outbox keeps events: what left it undelivered is
    listed as a loss (how many, which seqs; nothing to retry), never dropped unsaid; the
    session's next events are delivered as before, with no loss listed twice."""
    # scaled down: a delivery tried for 3.6 s (0.001 h), events kept 2 s
    live = await serve(
        echo_agent(),
        api_keys=("k1",),
        webhook_allow_private=True,
        webhook_retry_hours=0.001,
        event_retention_ms=2000,
        idempotency_ms=2000,
    )
    async with live.client("k1") as c:
        wid = await subscribe(c, receiver, "down", ["turn.completed"], fail_every=1)  # the endpoint is down
        sid = await turns(c, "one", "two", "three")  # session.created and 5 events a turn: seq 1-16
        await receiver.until(lambda r: len(r.attempts("down")) >= 1)  # the first turn.completed tried

        async def outbox_gone() -> bool:
            return not await redis.exists(SessionKeys(sid).outbox)

        await eventually(outbox_gone, 10)
        receiver.paths["down"].fail_every = 0  # the endpoint is back

        async def listed() -> bool:
            return bool((await c.get(f"/v1/webhooks/{wid}/failures")).json()["failures"])

        await eventually(listed, 30)
        (lost,) = (await c.get(f"/v1/webhooks/{wid}/failures")).json()["failures"]
        assert lost["session_id"] == sid and lost["lost"] == 16, lost
        # (where the relay stood: nothing delivered yet, so the subscription's start, before the session's)
        created = (await c.get(f"/v1/sessions/{sid}")).json()["created_at"]
        assert streamids.ms_of(lost["event_id"]) <= created * 1000
        assert "(seq 1-16) left the outbox before delivery" in lost["error"]
        assert not receiver.delivered("down")
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "four"})
        assert r.json()["status"] == "completed"
        await receiver.until(lambda r: len(r.delivered("down")) == 1)
        (four,) = receiver.delivered("down")
        assert json.loads(four.body)["seq"] == 21  # (seq 17-21: the fourth turn's)
        await relay_done(redis)
        assert [f["lost"] for f in (await c.get(f"/v1/webhooks/{wid}/failures")).json()["failures"]] == [16]
        retried = (await c.post(f"/v1/webhooks/{wid}/failures/retry")).json()
        assert retried == {"retried": 0}  # nothing to deliver again: the loss is cleared
        assert (await c.get(f"/v1/webhooks/{wid}/failures")).json()["failures"] == []

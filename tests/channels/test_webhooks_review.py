"""Outbound event webhooks, the harder cases (found in review): a turn running when the key
subscribes, deliveries after a 410 or a DELETE, the subscriptions cache, retrying a disabled
webhook's failures."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from harness.store import new_subscription
from tests.channels.slack_support import echo_agent, eventually
from tests.channels.webhook_receiver import Receiver

pytestmark = pytest.mark.asyncio


async def subscribe(c: httpx.AsyncClient, receiver: Receiver, path: str, events: list[str], **behaviour: Any) -> str:
    r = await c.post("/v1/webhooks", json={"url": receiver.url(path), "events": events})
    assert r.status_code == 201, r.text
    receiver.expect(path, r.json()["secret"], **behaviour)
    return str(r.json()["id"])


async def started(c: httpx.AsyncClient, sid: str) -> None:
    async def running() -> bool:
        return (await c.get(f"/v1/sessions/{sid}")).json().get("status") == "running"

    await eventually(running, 10)


async def test_a_turn_running_when_the_key_subscribes_has_its_events_delivered(serve: Any, receiver: Receiver) -> None:
    """The subscription is made (and the owner's cached targets dropped) while a turn of the key's session is
    running; its turn.completed is committed after the subscription exists. Before the fix: relay jobs are
    queued only with API writes (create/submit/respond/cancel/enqueue), and the submit came
    before the subscription: no relay job for wh:<id>, so turn.completed is never delivered
    (until, if ever, the session is written to again)."""
    gate = asyncio.Event()
    live = await serve(echo_agent(gate=gate), api_keys=("k1",), webhook_allow_private=True)
    async with live.client("k1") as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hi"})
        assert r.status_code in (200, 201, 202), r.text
        await started(c, sid)
        await subscribe(c, receiver, "late", ["turn.completed"])
        gate.set()

        async def completed() -> bool:
            return (await c.get(f"/v1/sessions/{sid}")).json().get("status") != "running"

        await eventually(completed, 10)
        try:
            await receiver.until(lambda r: len(r.delivered("late")) == 1, timeout=6)
        except AssertionError:
            pytest.fail("turn.completed, committed after the subscription was made, was never delivered")


async def test_no_delivery_after_410(serve: Any, receiver: Receiver, redis: Redis) -> None:
    """410 on turn.started disables the subscription; the relay following the session keeps
    the WebhookDestination it resolved (its `sub` still active: disable() writes Redis, forget()
    only drops the cache entry) and POSTs turn.completed as well (410 again, a second dead
    letter). Likewise every other session being followed for it at that moment."""
    gate = asyncio.Event()
    live = await serve(echo_agent(gate=gate), api_keys=("k1",), webhook_allow_private=True)
    async with live.client("k1") as c:
        wid = await subscribe(c, receiver, "gone", ["turn.started", "turn.completed"], gone=True)
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hi"})
        await receiver.until(lambda r: len(r.attempts("gone")) == 1, timeout=10)
        assert "410" in ((await c.get(f"/v1/webhooks/{wid}")).json()["disabled"] or "")
        gate.set()
        await settled(c, sid, redis)
        posted = [d.body[:60] for d in receiver.attempts("gone")]
        assert len(posted) == 1, f"POSTed after the 410 disabled the webhook: {posted}"


async def test_no_delivery_after_delete(serve: Any, receiver: Receiver, redis: Redis) -> None:
    """DELETE /v1/webhooks/{id} answered 204, then the session's turn completes: the relay that
    was following the session still holds the destination and POSTs turn.completed to the
    deleted webhook's URL (for as long as the session keeps running)."""
    gate = asyncio.Event()
    live = await serve(echo_agent(gate=gate), api_keys=("k1",), webhook_allow_private=True)
    async with live.client("k1") as c:
        wid = await subscribe(c, receiver, "del", ["turn.started", "turn.completed"])
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hi"})
        await receiver.until(lambda r: len(r.delivered("del")) == 1, timeout=10)
        assert (await c.delete(f"/v1/webhooks/{wid}")).status_code == 204
        deleted_at = time.time()
        gate.set()
        await settled(c, sid, redis)
        after = [d for d in receiver.attempts("del") if d.at > deleted_at]
        assert not after, f"{len(after)} POST(s) to a deleted webhook"


async def test_the_hooks_cache_is_not_refilled_with_a_stale_read(make_harness: Any, redis: Redis) -> None:
    """Adding a subscription drops the owner's cached targets, but a `targets()` read that began
    before the subscription was added and returns after it would store the old list for another
    second: a session created right after subscribing, in the same process, gets no relay job
    for it (its events are not delivered unless the session is written to again)."""
    h = await make_harness(echo_agent(), run_turns=False)
    hooks = h.store.hooks
    real_of = hooks.of
    hold = asyncio.Event()

    reading = asyncio.Event()

    async def slow_of(owner: str) -> list[Any]:
        subs = await real_of(owner)  # read before the subscription exists
        reading.set()
        await hold.wait()  # (a slow reply)
        return subs

    hooks.of = slow_of  # type: ignore[method-assign]
    concurrent = asyncio.create_task(hooks.targets("k"))  # another request of the key, in flight
    await asyncio.wait_for(reading.wait(), 5)
    hooks.of = real_of  # type: ignore[method-assign]
    sub = new_subscription(
        "wh_x", "k", url="https://example.com/", events=["*"], secret="whsec_" + "A" * 44, description=""
    )
    await hooks.add(sub)  # POST /v1/webhooks
    hold.set()
    await concurrent
    sid = await h.sessions.create("k")  # right after the 201
    jobs = [f[b"s"].decode() for _, f in await redis.xrange("keel:{relay}:stream")]
    assert f"{sid} wh:wh_x" in jobs, f"no relay job for the new subscription: {jobs}"


async def test_retrying_the_failures_of_a_disabled_webhook_does_not_drop_them(
    serve: Any, receiver: Receiver, redis: Redis
) -> None:
    """After a 410 the failure is listed; retrying it is refused (409) while the webhook is
    disabled, and the failure stays listed (before the fix: 202, and the failure dropped)."""
    from tests.channels.slack_support import relay_done

    live = await serve(echo_agent(), api_keys=("k1",), webhook_allow_private=True)
    async with live.client("k1") as c:
        wid = await subscribe(c, receiver, "gone", ["turn.completed"], gone=True)
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hi"})
        await receiver.until(lambda r: len(r.attempts("gone")) == 1, timeout=10)

        async def listed() -> bool:
            return bool((await c.get(f"/v1/webhooks/{wid}/failures")).json()["failures"])

        await eventually(listed, 10)
        r = await c.post(f"/v1/webhooks/{wid}/failures/retry")
        assert r.status_code == 409 and r.json()["error"]["code"] == "webhook_disabled"
        await relay_done(redis)
        left = (await c.get(f"/v1/webhooks/{wid}/failures")).json()["failures"]
        assert len(left) == 1  # kept, still listed


async def settled(c: httpx.AsyncClient, sid: str, redis: Redis) -> None:
    """The session's turn is over and the relays have nothing left to do."""
    from tests.channels.slack_support import relay_done

    async def idle() -> bool:
        return (await c.get(f"/v1/sessions/{sid}")).json().get("status") == "idle"

    await eventually(idle, 10)
    await relay_done(redis)

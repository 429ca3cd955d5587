"""The delivery relay's parking (RetryPolicy.park_after), dead-letter redelivery, its
slots, and jobs for destinations a process does not serve. A fake destination, driven directly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import pytest
from redis.asyncio import Redis

from harness.events import StoredEvent
from harness.relay import Outbound, Retry, RetryPolicy
from harness.store import Deliveries
from harness.store.deliveries import relay_job
from harness.store.keys import SessionKeys
from tests.channels.slack_support import echo_agent, eventually

pytestmark = pytest.mark.asyncio


class Fake:
    """Posts every session.created; `mode`: "fail" (Retry with a backoff), "busy" (Retry after
    `after` s), "ok", "slow" (takes `slow_s`)."""

    def __init__(self, name: str, policy: RetryPolicy | None, mode: str = "fail", after: float = 1.0) -> None:
        self.name = name
        self.retry = policy
        self.mode = mode
        self.after = after
        self.slow_s = 3.0
        self.sends: list[tuple[str, float, str]] = []  # (ref, when, outcome)
        self.calls = 0

    def render(self, event: StoredEvent, where: Mapping[str, Any], refs: Mapping[str, str]) -> list[Outbound]:
        if event.type != "session.created":
            return []
        return [Outbound("post", f"e:{event.id}", {})]

    def working(self, turn_id: str, where: Mapping[str, Any]) -> Outbound | None:
        return None

    async def send(self, out: Outbound, where: Mapping[str, Any], handle: str | None) -> str:
        self.calls += 1
        if self.mode == "slow":
            await asyncio.sleep(self.slow_s)
        self.sends.append((out.ref, time.time(), self.mode))
        if self.mode == "fail":
            raise Retry("500", None)
        if self.mode == "busy":
            raise Retry("503", self.after)
        return out.ref

    async def find(self, refs: list[str], where: Mapping[str, Any], since: str) -> dict[str, str]:
        return {}  # like WebhookDestination: nothing found, delivered again


async def test_a_parked_delivery_still_gives_up_after_give_up_after(make_harness: Any, redis: Redis) -> None:
    """give_up_after=1.5 s, waits over 0.25 s park. A receiver that is always down must become
    a dead letter after ~1.5 s of failing. Before the fix: on resume, recover() runs dest.find() through
    attempt(), which succeeds and sets session.failing = None: fails and since restart from
    zero at every resume, so give_up_after is never reached (and the backoff never grows past
    park_after): retried forever, never dead-lettered."""
    policy = RetryPolicy(attempts=None, give_up_after=1.5, first=0.1, cap=10.0, park_after=0.25)
    dest = Fake("fake", policy, "fail")
    h = await make_harness(echo_agent(), run_turns=False)
    await h.start_relay([dest])
    sid = await h.sessions.create("k")
    await redis.execute_command(*relay_job(sid, "fake"))

    async def buried() -> bool:
        return bool(await h.store.deliveries.dead("fake"))

    try:
        await eventually(buried, 8.0)
    except TimeoutError:
        pytest.fail(f"no dead letter after 8 s of failing (give_up_after 1.5 s); {len(dest.sends)} attempts made")


async def test_a_parked_redelivery_of_a_dead_letter_is_not_lost(make_harness: Any, redis: Redis) -> None:
    """An operator retries a dead letter while the receiver still answers 503 Retry-After: 1
    (> park_after). Before the fix: _serve parks it with deliveries.delay(sid, dest) - without the event id
    - and acknowledges the redelivery job; the dead letter was already removed by retry(). The
    resumed job follows from the cursor (past the event): the event is never delivered again
    and no longer listed."""
    policy = RetryPolicy(attempts=None, give_up_after=0.25, first=0.1, cap=10.0, park_after=0.5)
    dest = Fake("fake", policy, "fail")
    h = await make_harness(echo_agent(), run_turns=False)
    await h.start_relay([dest])
    sid = await h.sessions.create("k")
    await redis.execute_command(*relay_job(sid, "fake"))

    async def buried() -> bool:
        return bool(await h.store.deliveries.dead("fake"))

    await eventually(buried, 5.0)
    (letter,) = await h.store.deliveries.dead("fake")
    dest.mode, dest.after = "busy", 1.0  # still down, asks for a second
    assert await h.webhooks.retry_dead_letters("fake") == 1

    async def tried_again() -> bool:
        return any(o == "busy" for _, _, o in dest.sends)

    await eventually(tried_again, 5.0)
    dest.mode = "ok"  # the receiver is back

    async def delivered_or_listed() -> bool:
        ok = any(o == "ok" and ref == f"e:{letter.event_id}" for ref, _, o in dest.sends)
        return ok or bool(await h.store.deliveries.dead("fake"))

    try:
        await eventually(delivered_or_listed, 6.0)
    except TimeoutError:
        pytest.fail("the retried dead letter was neither delivered nor listed again: lost")


async def test_slow_destinations_take_every_relay_slot(make_harness: Any, redis: Redis) -> None:
    """The relay's slots (concurrency, 256 in the app) are shared by all destinations; a call's
    own duration (a webhook timeout is 15 s) never parks. With 2 slots, two sessions for a
    receiver that hangs hold up a third session's delivery to another destination (Slack, or
    another API key's webhook) for the whole hang. At 256 slots: 13 sessions x 20 webhooks."""
    slow = Fake("slow", RetryPolicy(attempts=1), "slow")
    slow.slow_s = 4.0
    quick = Fake("quick", None, "ok")
    h = await make_harness(echo_agent(), run_turns=False)
    await h.start_relay([slow, quick], concurrency=2)
    for _ in range(2):
        sid = await h.sessions.create("k")
        await redis.execute_command(*relay_job(sid, "slow"))

    async def slow_busy() -> bool:
        return slow.calls >= 1

    await eventually(slow_busy, 5.0)  # the slow destination is in its calls (as many as its share)
    sid = await h.sessions.create("k")
    t0 = time.time()
    await redis.execute_command(*relay_job(sid, "quick"))

    async def done() -> bool:
        return bool(quick.sends)

    await eventually(done, 10.0)
    waited = quick.sends[0][1] - t0
    assert waited < 1.0, f"the quick destination waited {waited:.1f} s behind the slow one"


async def test_a_job_for_a_channel_this_process_does_not_serve_is_left_for_another(
    make_harness: Any, redis: Redis
) -> None:
    """Relay._dispatch leaves a job for a destination it does not serve to another process -
    but only when resolve is None. Every app process now has resolve (OutboundWebhooks), which
    answers None for "slack"; _serve then counts it finished and acknowledges it: a process
    without the Slack settings (a rolling deploy that turns Slack on) eats Slack's jobs."""
    from channels.webhooks.outbound import OutboundWebhooks

    h = await make_harness(echo_agent(), run_turns=False)
    outbound = OutboundWebhooks(h, allow_private=True, timeout=5, retry_hours=1)
    await h.start_relay([], resolve=outbound.resolve)
    sid = await h.sessions.create("k")
    await redis.execute_command(*relay_job(sid, "slack"))

    async def taken() -> bool:  # read by this process's relay (pending for it) ...
        return int((await redis.xpending("keel:{relay}:stream", "relays"))["pending"]) == 1

    await eventually(taken, 5.0)
    left = int(await redis.xlen("keel:{relay}:stream"))  # ... and not acknowledged
    assert left == 1, "the Slack job was acknowledged (and deleted) by a process that does not serve Slack"


class Everything(Fake):
    """Posts every event a session has (so the relay's cursor moves with each)."""

    def render(self, event: StoredEvent, where: Mapping[str, Any], refs: Mapping[str, str]) -> list[Outbound]:
        return [Outbound("post", f"e:{event.id}", {})]


async def test_events_that_left_the_outbox_between_two_reads_are_listed_once_as_lost(
    make_harness: Any, redis: Redis
) -> None:
    """The relay delivered up to seq 2; seqs 3-4 then leave the outbox (as its retention trims
    it) while seq 5 stays: the relay lists 2 events lost after seq 2's event, delivers seq 5,
    and a later read lists nothing again."""
    dest = Everything("fake", None, "ok")
    h = await make_harness(echo_agent(), run_turns=False, lease_ms=500)  # (the stopped relay's lease lapses soon)
    await h.start_relay([dest])
    sid = await h.sessions.create("k")
    await h.sessions.submit(sid, "k", "one")  # seq 2 (no runner here: queued)
    await redis.execute_command(*relay_job(sid, "fake"))

    async def delivered(n: int) -> bool:
        return len(dest.sends) == n

    await eventually(lambda: delivered(2), 5.0)
    await h.relay.stop()  # (the relay away meanwhile: it follows a running session live)
    for text in ("two", "three", "four"):  # seqs 3, 4, 5
        await h.sessions.submit(sid, "k", text)
    events = await h.store.outbox.events(sid, "0-0")
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    await redis.xtrim(SessionKeys(sid).outbox, minid=events[4].id, approximate=False)  # seqs 1-4 leave
    await h.start_relay([dest])
    await redis.execute_command(*relay_job(sid, "fake"))

    async def listed() -> bool:
        return bool(await h.store.deliveries.dead("fake"))

    await eventually(listed, 5.0)
    (lost,) = await h.store.deliveries.dead("fake")
    assert (lost.event_id, lost.lost, lost.lost_from) == (events[1].id, 2, 3)
    await eventually(lambda: delivered(3), 5.0)
    assert dest.sends[-1][0] == f"e:{events[4].id}"
    await h.sessions.submit(sid, "k", "five")  # seq 6: read next, after 5
    await redis.execute_command(*relay_job(sid, "fake"))
    await eventually(lambda: delivered(4), 5.0)
    assert len(await h.store.deliveries.dead("fake")) == 1


async def test_a_retry_keeps_a_failure_its_relay_listed_again_meanwhile(redis: Redis) -> None:
    """The retry writes its jobs, then removes the failures it read: one a relay took the job
    of and listed again in between (it failed again at once, or its event had left) stays."""
    deliveries = Deliveries(redis)
    for sid in ("ses_a", "ses_b"):
        await redis.xadd(SessionKeys(sid).outbox, {"t": "session.created"}, id="1-0")  # (the events are kept)
        await deliveries.bury(sid, "1-0", "wh:x", "refused", 3)
    write = deliveries._write

    async def a_fast_relay(commands: list[tuple[Any, ...]]) -> None:
        await write(commands)
        if commands[0][0] == "XADD":  # (the jobs: one relay is done with ses_a's before the removal)
            await deliveries.bury("ses_a", "1-0", "wh:x", "failed again", 1)

    deliveries._write = a_fast_relay  # type: ignore[method-assign]
    assert await deliveries.retry("wh:x") == 2
    (letter,) = await deliveries.dead("wh:x")
    assert (letter.session_id, letter.error) == ("ses_a", "failed again")


async def test_a_redelivery_whose_event_left_the_outbox_is_listed_again(make_harness: Any, redis: Redis) -> None:
    """The event leaves the outbox between a retry and its relay's read (the retry checked it
    was there): the failure is listed again as gone, not dropped; the next retry clears it."""
    dest = Fake("fake", None, "ok")
    h = await make_harness(echo_agent(), run_turns=False)
    await h.start_relay([dest])
    sid = await h.sessions.create("k")
    await redis.execute_command(*relay_job(sid, "fake", "1-0"))  # (a redelivery of an event not there)

    async def listed() -> bool:
        return bool(await h.store.deliveries.dead("fake"))

    await eventually(listed, 5.0)
    (letter,) = await h.store.deliveries.dead("fake")
    assert (letter.session_id, letter.event_id, letter.gone) == (sid, "1-0", True) and "left the outbox" in letter.error
    assert await h.store.deliveries.retry("fake") == 0
    assert await h.store.deliveries.dead("fake") == []

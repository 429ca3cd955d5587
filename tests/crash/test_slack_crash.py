"""Crash keel at each point of the delivery relay (a post in doubt not made yet; a post made,
the cursor not moved; in the middle of a burst of posts), start a replacement on the same Redis
and the same local Slack server: every reply is posted exactly once, in session order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from harness.store import Deliveries
from tests.channels.slack_server import BOT, SECRET, TOKEN, FakeSlack, click_body, event_body, signed
from tests.channels.slack_support import click, dead_letters, relay_done
from tests.conftest import ValkeyServer, free_port
from tests.service import Service

THREAD = "1700000100.000100"


def keel(tmp_path: Path, valkey: ValkeyServer, slack: FakeSlack) -> Service:
    return Service(
        tmp_path,
        free_port(),
        REDIS_URL=valkey.url,
        KEEL_AGENT="tests.crash_agent:agent",
        KEEL_TEST_LOG=str(tmp_path / "calls.jsonl"),
        KEEL_LEASE_MS="1000",
        SLACK_SIGNING_SECRET=SECRET,
        SLACK_BOT_TOKEN=TOKEN,
        KEEL_SLACK_API_URL=slack.url,
    )


async def send(svc: Service, text: str, ts: str, *, first: bool = False) -> None:
    body = event_body(f"<@{BOT}> {text}", ts=ts) if first else event_body(text, ts=ts, kind="message", thread_ts=THREAD)
    async with httpx.AsyncClient(base_url=svc.base, timeout=10) as c:
        r = await c.post("/v1/slack/events", content=body, headers={"Content-Type": "application/json", **signed(body)})
        assert r.status_code == 200


async def send_while_up(svc: Service, messages: list[tuple[str, str]]) -> None:
    """Send these thread messages in order until keel is down; what was not sent stays in
    `messages` (Slack retries an event whose delivery failed)."""
    while messages:
        try:
            await send(svc, *messages[0])
        except httpx.TransportError:
            return
        messages.pop(0)


def texts(slack: FakeSlack) -> list[str]:
    return [m.text for m in slack.posts(THREAD)]


def long_parts(n: int) -> list[str]:
    whole = "".join(chr(97 + i // 3900 % 26) for i in range(n))
    return [whole[i : i + 3900] for i in range(0, n, 3900)]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["relay.before_send", "relay.after_send"])
async def test_a_crash_at_a_relay_point_posts_the_reply_once(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, slack: FakeSlack, point: str
) -> None:
    svc = keel(tmp_path, valkey, slack)
    try:
        svc.start(KEEL_FAILPOINTS=f"{point}=exit")
        await send(svc, "hello", THREAD, first=True)
        assert await asyncio.to_thread(svc.wait_exit) == 137
        assert texts(slack) == ([] if point == "relay.before_send" else ["re: hello"])
        svc.start()  # nothing new is sent: the dead process's relay job is reclaimed
        await slack.until(lambda s: len(s.posts(THREAD)) >= 1)
        await send(svc, "more", "1700000101.000100")  # and the session goes on
        await slack.until(lambda s: len(s.posts(THREAD)) >= 2)
        assert texts(slack) == ["re: hello", "re: more"]
        if point == "relay.after_send":
            assert slack.count("conversations.replies") >= 1  # reconciled, not posted again
    finally:
        svc.stop()


@pytest.mark.slow
async def test_a_crash_in_the_middle_of_a_burst_of_posts(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, slack: FakeSlack
) -> None:
    svc = keel(tmp_path, valkey, slack)
    try:
        svc.start(KEEL_FAILPOINTS="relay.after_send=exit@2")  # 2 of the long reply's 3 posts made
        await send(svc, "long 9000", THREAD, first=True)
        unsent = [(f"m{n}", f"1700000101.00010{n}") for n in range(3)]
        await send_while_up(svc, unsent)
        assert await asyncio.to_thread(svc.wait_exit) == 137
        assert texts(slack) == long_parts(9000)[:2]
        svc.start(KEEL_FAILPOINTS="relay.after_send=exit@3")  # and once more, further on
        await send_while_up(svc, unsent)
        assert await asyncio.to_thread(svc.wait_exit) == 137
        svc.start()
        await send_while_up(svc, unsent)
        assert unsent == []
        want = [*long_parts(9000), "re: m0", "re: m1", "re: m2"]
        await slack.until(lambda s: len(s.posts(THREAD)) >= len(want), timeout=30)
        await send(svc, "last", "1700000102.000100")
        await slack.until(lambda s: len(s.posts(THREAD)) >= len(want) + 1, timeout=30)
        assert texts(slack) == [*want, "re: last"]
    finally:
        svc.stop()


@pytest.mark.slow
async def test_a_dead_letter_retried_after_a_crash_does_not_post_what_was_in_doubt_again(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, slack: FakeSlack
) -> None:
    svc = keel(tmp_path, valkey, slack)
    try:
        svc.start(KEEL_FAILPOINTS="relay.after_send=exit")  # exits after the first post made
        slack.fail("chat.postMessage", status=200, error="not_in_channel", times=1)
        await send(svc, "hello", THREAD, first=True)  # its reply refused: a dead letter
        await dead_letters(redis)
        await send(svc, "more", "1700000101.000100")  # "re: more" posted, then the crash
        assert await asyncio.to_thread(svc.wait_exit) == 137
        assert texts(slack) == ["re: more"]
        assert await Deliveries(redis).retry("slack") == 1  # the operator retries before keel is back
        svc.start()
        await slack.until(lambda s: len(s.posts(THREAD)) >= 2)
        await relay_done(redis)
        assert texts(slack) == ["re: more", "re: hello"]  # (the retried one after: out of order)
    finally:
        svc.stop()


@pytest.mark.slow
async def test_an_approval_post_found_after_a_crash_is_updated_when_decided(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, slack: FakeSlack
) -> None:
    svc = keel(tmp_path, valkey, slack)
    try:
        svc.start(KEEL_FAILPOINTS="relay.after_send=exit")  # the approval message posted, then the crash
        await send(svc, "pay 5", THREAD, first=True)
        assert await asyncio.to_thread(svc.wait_exit) == 137
        (ask,) = slack.posts(THREAD)
        assert ask.blocks
        svc.start()  # the dead relay's job is reclaimed: the post in doubt is found, not made again
        await relay_done(redis)
        svc.stop()  # and a restart while the request waits: the next relay knows only Redis
        svc.start()
        async with httpx.AsyncClient(base_url=svc.base, timeout=10) as c:
            assert (await click(c, click_body(ask, "approve"))).status_code == 200
        await slack.until(lambda s: any(m.text == "done: charged 5" for m in s.posts(THREAD)))
        await slack.until(lambda s: "Approved by <@U0ALICE>" in s.posts(THREAD)[0].text)
        assert len(slack.posts(THREAD)) == 2
    finally:
        svc.stop()

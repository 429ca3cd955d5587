"""The delivery relay's harder cases, with the Slack channel: sessions waiting for an answer
let go of their relay, dead letters retried once and reconciled, long replies in parts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from channels.webhooks.slack import session_for
from harness import Agent
from harness.models import ModelReply, ModelRequest, ScriptedModel
from harness.relay import Relay
from harness.store import Deliveries
from tests.channels.slack_server import BOT, TEAM, FakeSlack, event_body
from tests.channels.slack_support import dead_letters, echo_agent, eventually, post_event, relay_done

pytestmark = pytest.mark.asyncio


async def test_a_session_waiting_for_an_answer_lets_go_of_its_relay(keel: Any, slack: FakeSlack, redis: Redis) -> None:
    c = await keel(echo_agent())
    thread = "1700000030.000100"
    await post_event(c, event_body(f"<@{BOT}> wipe disk", ts=thread))
    await slack.until(lambda s: any(m.blocks for m in s.posts(thread)))
    sid = session_for(TEAM, "C0GENERAL", thread)
    assert await redis.hget(f"keel:{{{sid}}}:meta", "status") == b"waiting"

    async def let_go() -> bool:
        return not await redis.exists(f"keel:{{{sid}}}:relay:slack:lease")

    await eventually(let_go, 5.0)
    await relay_done(redis)


async def test_pending_approvals_do_not_starve_other_conversations(
    keel: Any, slack: FakeSlack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(Relay.__init__.__kwdefaults__, "concurrency", 2)  # (256 by default: the same, later)
    c = await keel(echo_agent())
    for n in range(3):
        thread = f"1700000040.00010{n}"
        await post_event(c, event_body(f"<@{BOT}> wipe t{n}", ts=thread))
        await slack.until(lambda s, t=thread: any(m.blocks for m in s.posts(t)))
    other = "1700000050.000100"
    await post_event(c, event_body(f"<@{BOT}> hello", ts=other))
    await slack.until(lambda s: len(s.posts(other)) == 1, timeout=10)


async def test_a_retried_long_reply_after_a_working_post_is_posted_once(
    keel: Any, slack: FakeSlack, redis: Redis
) -> None:
    """The reply's first part went into the working post, the second was posted, the third
    refused: the operator's retry posts only the third."""
    parts = ["a" * 3900, "b" * 3900, "c" * 100]
    gate = asyncio.Event()

    async def script(r: ModelRequest) -> ModelReply:
        await gate.wait()
        return ModelReply(text="".join(parts))

    c = await keel(Agent(instructions="t", model=ScriptedModel(script)))
    thread = "1700000300.000100"
    await post_event(c, event_body(f"<@{BOT}> long", ts=thread))
    await slack.until(lambda s: len(s.posts(thread)) == 1)  # the working post
    slack.refuse_text("c", "not_in_channel")
    gate.set()
    await dead_letters(redis)
    assert [m.text[0] for m in slack.posts(thread)] == ["a", "b"]
    assert await Deliveries(redis).retry("slack") == 1
    await slack.until(lambda s: any(m.text.startswith("c") for m in s.posts(thread)))
    await relay_done(redis)
    assert [m.text[:1] for m in slack.posts(thread)] == ["a", "b", "c"]
    assert await Deliveries(redis).dead("slack") == []


async def test_a_retry_whose_reconcile_is_refused_is_a_dead_letter_again(
    keel: Any, slack: FakeSlack, redis: Redis
) -> None:
    c = await keel(echo_agent())
    await post_event(c, event_body(f"<@{BOT}> hi", ts="1700000400.000100", channel="C0GONE"))  # the bot was removed
    (first,) = await dead_letters(redis)
    slack.fail("conversations.replies", status=200, error="channel_not_found", times=1000)
    assert await Deliveries(redis).retry("slack") == 1
    (again,) = await dead_letters(redis)
    await relay_done(redis)  # the retry's job was acknowledged: not tried again and again
    assert again.event_id == first.event_id and "channel_not_found" in again.error
    assert slack.count("conversations.replies") == 1

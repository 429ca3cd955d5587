"""The Slack channel against a local server that speaks Slack's Web API, driven through keel's
own slack_sdk client, with requests signed as Slack signs them."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlencode

import pytest
from redis.asyncio import Redis

from channels.webhooks.slack import session_for
from harness import Agent
from harness.models import ModelReply, ModelRequest, ScriptedModel
from tests.channels.slack_server import BOT, SECRET, TEAM, TOKEN, FakeSlack, click_body, event_body, signed
from tests.channels.slack_support import click, echo_agent, post_event, relay_done, replies
from tests.harness.session_keys import keys_of

pytestmark = pytest.mark.asyncio


async def test_a_mention_is_acked_and_answered_once_in_its_thread(keel: Any, slack: FakeSlack, redis: Redis) -> None:
    c = await keel(echo_agent())
    body = event_body(f"<@{BOT}> hello there", ts="1700000001.000100")
    r = await post_event(c, body)
    assert r.status_code == 200 and r.content == b""
    await slack.until(lambda s: len(s.posts("1700000001.000100")) == 1)
    (post,) = slack.posts("1700000001.000100")
    assert post.text == "re:hello there" and post.channel == "C0GENERAL"  # the mention is stripped
    assert post.metadata is not None and post.metadata["event_type"] == "keel_post"
    # Slack's retries, the same message as a `message` event, and a replay: one message
    for n in ("1", "2", "3"):
        assert (
            await post_event(c, body, **{"X-Slack-Retry-Num": n, "X-Slack-Retry-Reason": "http_timeout"})
        ).status_code == 200
    as_message = event_body(f"<@{BOT}> hello there", ts="1700000001.000100", kind="message", channel_type="channel")
    assert (await post_event(c, as_message)).status_code == 200
    # a reply in the thread (no mention) is the session's next message: its reply comes after
    # anything the duplicates could have caused
    follow = event_body("and more", ts="1700000002.000200", kind="message", thread_ts="1700000001.000100")
    assert (await post_event(c, follow)).status_code == 200
    await slack.until(lambda s: len(s.posts("1700000001.000100")) >= 2)
    assert replies(slack, "1700000001.000100") == ["re:hello there", "re:and more"]
    sid = session_for(TEAM, "C0GENERAL", "1700000001.000100")
    types = [e[1][b"t"] for e in await redis.xrange(f"keel:{{{sid}}}:outbox")]
    assert types.count(b"message.received") == 2 and types[0] == b"session.created"


async def test_who_wrote_it_is_page_context_not_history(keel: Any, slack: FakeSlack, serve: Any) -> None:
    seen: list[ModelRequest] = []

    def script(r: ModelRequest) -> ModelReply:
        seen.append(r)
        return ModelReply(text="ok")

    c = await keel(Agent(instructions="t", model=ScriptedModel(script)))
    await post_event(c, event_body(f"<@{BOT}> first", ts="1700000003.000100", user="U0CAROL"))
    await slack.until(lambda s: len(s.posts("1700000003.000100")) == 1)
    texts = [m.text for m in seen[0].messages]
    assert any("<@U0CAROL>" in t and "C0GENERAL" in t for t in texts)
    assert texts[-1] == "first"
    await post_event(
        c, event_body("second", ts="1700000004.000100", kind="message", user="U0DAN", thread_ts="1700000003.000100")
    )
    await slack.until(lambda s: len(s.posts("1700000003.000100")) == 2)
    later = [m.text for m in seen[1].messages]
    assert not any("U0CAROL" in t for t in later)  # the first turn's context is gone
    assert any("<@U0DAN>" in t for t in later)


async def test_what_keel_ignores(keel: Any, slack: FakeSlack, redis: Redis) -> None:
    c = await keel(echo_agent())
    ignored = [
        event_body("plain channel chatter", ts="1700000010.000100", kind="message"),  # not for keel
        event_body("a thread keel is not in", ts="1700000011.000100", kind="message", thread_ts="1700000009.1"),
        event_body(f"<@{BOT}> mine", ts="1700000012.000100", user=BOT),  # the bot itself
        event_body("bot post", ts="1700000013.000100", kind="message", bot_id="B0BOT", channel_type="im"),
        event_body("edited", ts="1700000014.000100", kind="message", subtype="message_changed", channel_type="im"),
        event_body("joined", ts="1700000015.000100", kind="message", subtype="channel_join", channel_type="im"),
    ]
    for body in ignored:
        assert (await post_event(c, body)).status_code == 200
    # a direct message starts a conversation of its own, answered in its thread
    dm = event_body("hi in private", ts="1700000016.000100", kind="message", channel="D0DM", channel_type="im")
    assert (await post_event(c, dm)).status_code == 200
    await slack.until(lambda s: len(s.posts("1700000016.000100")) == 1)
    assert [m.text for m in slack.posts()] == ["re:hi in private"]
    for ts in ("1700000010.000100", "1700000009.1", "1700000012.000100", "1700000013.000100"):
        assert not await redis.exists(f"keel:{{{session_for(TEAM, 'C0GENERAL', ts)}}}:meta")


async def test_a_forged_or_stale_request_is_401_and_writes_nothing(keel: Any, slack: FakeSlack, redis: Redis) -> None:
    c = await keel(echo_agent())
    body = event_body(f"<@{BOT}> forged", ts="1700000020.000100")
    before = await redis.dbsize()
    forged = {"Content-Type": "application/json", **signed(body, secret="not-the-secret")}
    stale = {"Content-Type": "application/json", **signed(body, at=time.time() - 301)}
    tampered = {"Content-Type": "application/json", **signed(body)}
    cases = [
        await c.post("/v1/slack/events", content=body, headers=forged),
        await c.post("/v1/slack/events", content=body, headers=stale),
        await c.post("/v1/slack/events", content=body.replace(b"forged", b"FORGED"), headers=tampered),
        await c.post("/v1/slack/events", content=body),  # no signature at all
        await c.post("/v1/slack/interactivity", content=b"payload=%7B%7D", headers=forged),
    ]
    for r in cases:
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_signature"
    assert await redis.dbsize() == before
    assert not await redis.exists(f"keel:{{{session_for(TEAM, 'C0GENERAL', '1700000020.000100')}}}:meta")


async def test_url_verification_answers_its_challenge(keel: Any) -> None:
    c = await keel(echo_agent())
    body = json.dumps({"type": "url_verification", "token": "x", "challenge": "abc123"}).encode()
    r = await post_event(c, body)
    assert r.status_code == 200 and r.json() == {"challenge": "abc123"}


async def test_the_routes_take_no_api_key_but_the_api_still_does(keel: Any) -> None:
    c = await keel(echo_agent(), api_keys=("k1",))
    r = await post_event(c, event_body(f"<@{BOT}> keyless", ts="1700000025.000100"))
    assert r.status_code == 200
    assert (await c.post("/v1/sessions")).status_code == 401


async def test_approval_by_buttons(keel: Any, slack: FakeSlack, redis: Redis) -> None:
    ran: list[str] = []
    c = await keel(echo_agent(ran))
    thread = "1700000030.000100"
    await post_event(c, event_body(f"<@{BOT}> wipe disk", ts=thread))
    await slack.until(lambda s: any(m.blocks for m in s.posts(thread)))
    (ask,) = [m for m in slack.posts(thread) if m.blocks]
    assert "wipe" in ask.text
    # another user's click and another team's click change nothing
    assert (await click(c, click_body(ask, "approve", user="U0MALLORY"))).status_code == 200
    assert (await click(c, click_body(ask, "approve", team="T0OTHER"))).status_code == 200
    await slack.until(lambda s: len(s.ephemerals) == 1)
    assert slack.ephemerals[0]["user"] == "U0MALLORY" and "U0ALICE" in slack.ephemerals[0]["text"]
    sid = session_for(TEAM, "C0GENERAL", thread)
    assert (await redis.hget(f"keel:{{{sid}}}:meta", "status")) == b"waiting"
    # a forged click is 401
    forged = click_body(ask, "approve")
    r = await c.post(
        "/v1/slack/interactivity",
        content=forged,
        headers={"Content-Type": "application/x-www-form-urlencoded", **signed(forged, secret="nope")},
    )
    assert r.status_code == 401
    assert ran == []
    # the right user: the tool runs once; a double click is one answer
    first, second = await asyncio.gather(click(c, click_body(ask, "approve")), click(c, click_body(ask, "approve")))
    assert first.status_code == second.status_code == 200
    await slack.until(
        lambda s: (
            [m.text for m in s.posts(thread) if not m.blocks or m.updates]
            and any(m.text == "done: wiped disk" for m in s.posts(thread))
        )
    )
    assert ran == ["disk"]
    updated = next(m for m in slack.posts(thread) if m.ts == ask.ts)
    assert updated.updates == 1 and "Approved by <@U0ALICE>" in updated.text
    assert not any(b["type"] == "actions" for b in updated.blocks or [])  # the buttons are gone
    # a different decision after the first: an ephemeral "already answered", nothing else
    assert (await click(c, click_body(ask, "deny"))).status_code == 200
    await slack.until(lambda s: len(s.ephemerals) == 2)
    assert "already answered: approve" in slack.ephemerals[1]["text"]
    assert ran == ["disk"]
    assert [m.text for m in slack.posts(thread)][-1] == "done: wiped disk"


async def test_a_follow_up_past_the_queue_is_told_so_in_its_thread(keel: Any, slack: FakeSlack) -> None:
    """A thread reply refused as queue_full gets an ephemeral note to its author in the thread
    (it was dropped unsaid); the ones taken are answered."""
    gate = asyncio.Event()
    c = await keel(echo_agent(gate=gate), max_queued=1)
    root = "1700000040.000100"
    await post_event(c, event_body(f"<@{BOT}> first", ts=root))

    def follow(text: str, ts: str) -> bytes:
        return event_body(text, ts=ts, kind="message", thread_ts=root, user="U0DAN")

    assert (await post_event(c, follow("second", "1700000041.000100"))).status_code == 200  # (steered)
    assert (await post_event(c, follow("third", "1700000042.000100"))).status_code == 200  # (past the queue)
    await slack.until(lambda s: len(s.ephemerals) == 1)
    (note,) = slack.ephemerals
    assert note["user"] == "U0DAN" and note["thread_ts"] == root and note["channel"] == "C0GENERAL"
    assert "not taken" in note["text"]
    gate.set()
    await slack.until(lambda s: len(s.posts(root)) >= 1)
    assert not any("third" in t for t in replies(slack, root))


async def test_a_refused_mention_delivered_twice_is_told_of_once(keel: Any, slack: FakeSlack) -> None:
    """A thread reply that names the bot comes as two events (`app_mention` and `message`), one
    message: refused as queue_full, its author gets one note, not two."""
    gate = asyncio.Event()
    c = await keel(echo_agent(gate=gate), max_queued=1)
    root = "1700000050.000100"
    await post_event(c, event_body(f"<@{BOT}> first", ts=root))
    steer = event_body("second", ts="1700000051.000100", kind="message", thread_ts=root, user="U0DAN")
    assert (await post_event(c, steer)).status_code == 200  # (steered: the queue is full now)
    ts = "1700000052.000100"
    for kind in ("app_mention", "message"):
        twice = event_body(f"<@{BOT}> third", ts=ts, kind=kind, thread_ts=root, user="U0DAN", channel_type="channel")
        assert (await post_event(c, twice)).status_code == 200
    # (another refused message after them: its note comes after theirs)
    fourth = event_body("fourth", ts="1700000053.000100", kind="message", thread_ts=root, user="U0ERIN")
    assert (await post_event(c, fourth)).status_code == 200
    await slack.until(lambda s: any(n["user"] == "U0ERIN" for n in s.ephemerals))
    assert [n["user"] for n in slack.ephemerals] == ["U0DAN", "U0ERIN"]
    gate.set()


async def test_a_deleted_session_keeps_nothing_of_a_refused_message(serve: Any, slack: FakeSlack, redis: Redis) -> None:
    """What makes a refused message's note once is the session's, and goes with it."""
    gate = asyncio.Event()
    live = await serve(
        echo_agent(gate=gate),
        slack_signing_secret=SECRET,
        slack_bot_token=TOKEN,
        slack_api_url=slack.url,
        lease_ms=1000,
        max_queued=1,
    )
    c = live.client()
    root = "1700000060.000100"
    await post_event(c, event_body(f"<@{BOT}> first", ts=root))
    for text, ts in (("second", "1700000061.000100"), ("third", "1700000062.000100")):  # steered; refused
        assert (await post_event(c, event_body(text, ts=ts, kind="message", thread_ts=root))).status_code == 200
    await slack.until(lambda s: len(s.ephemerals) == 1)
    sid = session_for(TEAM, "C0GENERAL", root)
    await live.app.state.harness.sessions.delete(sid, f"slack:{TEAM}")
    gate.set()
    await relay_done(redis)  # (a relay that was delivering gives its lease back)
    assert await keys_of(redis, sid) == set()
    await c.aclose()


async def test_approvers_setting_widens_who_may_decide(keel: Any, slack: FakeSlack) -> None:
    ran: list[str] = []
    c = await keel(echo_agent(ran), slack_approvers=frozenset({"U0BOSS"}))
    thread = "1700000040.000100"
    await post_event(c, event_body(f"<@{BOT}> wipe tmp", ts=thread))
    await slack.until(lambda s: any(m.blocks for m in s.posts(thread)))
    (ask,) = [m for m in slack.posts(thread) if m.blocks]
    assert (await click(c, click_body(ask, "deny", user="U0BOSS"))).status_code == 200
    await slack.until(lambda s: any("Denied by <@U0BOSS>" in m.text for m in s.posts(thread)))
    await slack.until(lambda s: len(s.posts(thread)) == 2)  # the turn goes on and answers
    assert ran == []


async def test_a_slow_model_shows_a_working_post_replaced_by_the_reply(keel: Any, slack: FakeSlack) -> None:
    gate = asyncio.Event()
    c = await keel(echo_agent(gate=gate))
    thread = "1700000050.000100"
    await post_event(c, event_body(f"<@{BOT}> think hard", ts=thread))
    await slack.until(lambda s: len(s.posts(thread)) == 1)
    assert "Working" in slack.posts(thread)[0].text
    gate.set()
    await slack.until(lambda s: s.posts(thread)[0].text == "re:think hard")
    assert len(slack.posts(thread)) == 1 and slack.count("chat.update") == 1


async def test_rate_limits_are_waited_out_and_nothing_is_posted_twice(keel: Any, slack: FakeSlack) -> None:
    c = await keel(echo_agent())
    slack.fail("chat.postMessage", status=429, retry_after="1", times=2)
    thread = "1700000060.000100"
    started = time.monotonic()
    await post_event(c, event_body(f"<@{BOT}> patience", ts=thread))
    await slack.until(lambda s: len(s.posts(thread)) == 1)
    assert time.monotonic() - started >= 2.0  # Retry-After honoured twice
    assert slack.count("chat.postMessage") == 3
    assert replies(slack, thread) == ["re:patience"]


async def test_a_refused_post_is_a_dead_letter_an_operator_retries(keel: Any, slack: FakeSlack, redis: Redis) -> None:
    from harness.store import Deliveries

    c = await keel(echo_agent())
    slack.fail("chat.postMessage", status=200, error="not_in_channel", times=1)
    thread = "1700000070.000100"
    await post_event(c, event_body(f"<@{BOT}> first", ts=thread))
    for _ in range(200):
        dead = await Deliveries(redis).dead("slack")
        if dead:
            break
        await asyncio.sleep(0.05)
    (letter,) = dead
    assert letter.session_id == session_for(TEAM, "C0GENERAL", thread) and "not_in_channel" in letter.error
    # the relay went on: the next reply in the thread is posted
    await post_event(c, event_body("second", ts="1700000071.000100", kind="message", thread_ts=thread))
    await slack.until(lambda s: len(s.posts(thread)) == 1)
    assert replies(slack, thread) == ["re:second"]
    assert await Deliveries(redis).retry("slack") == 1
    await slack.until(lambda s: len(s.posts(thread)) == 2)
    assert sorted(replies(slack, thread)) == ["re:first", "re:second"]
    assert await Deliveries(redis).dead("slack") == []
    assert await Deliveries(redis).retry("slack") == 0


async def test_a_burst_of_1000_events_is_all_acked_and_answered(keel: Any, slack: FakeSlack) -> None:
    c = await keel(echo_agent())
    gate = asyncio.Semaphore(50)

    async def one(n: int) -> int:
        async with gate:
            r = await post_event(c, event_body(f"<@{BOT}> n{n}", ts=f"1700001000.{n:06d}"))
            return r.status_code

    codes = await asyncio.gather(*(one(n) for n in range(1000)))
    assert codes == [200] * 1000
    await slack.until(lambda s: len(s.posts()) >= 1000, timeout=120)
    assert sorted(m.text for m in slack.posts()) == sorted(f"re:n{n}" for n in range(1000))


async def test_an_accepted_event_or_click_costs_one_redis_round_trip(
    keel: Any, slack: FakeSlack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted at the two ways keel talks to Redis (its own wire, and redis-py), from the
    verified request to the ack: in the request's own work, and the message's SUBMIT, which the
    session's task makes for it (the turn that runs meanwhile, in that task, is not the ack's)."""
    import contextvars

    from redis.asyncio.client import Pipeline

    from channels.webhooks import base
    from harness.store import protocol
    from harness.store.wire import Pool

    window: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar("window", default=None)
    acking = {"now": False}  # (the session's task runs in a context of its own: not the window's)
    trips: list[str] = []

    def submits(args: tuple[Any, ...]) -> bool:
        commands = args[1] if len(args) > 1 else []
        return any(c[0] == "EVALSHA" and c[1] == protocol.SUBMIT.sha for c in commands)

    def counting(original: Any, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            open_ = window.get()
            task = asyncio.current_task()
            own = open_ and open_["open"] and task is not None and not task.get_name().startswith("keel-")
            if own or (acking["now"] and name == "wire" and submits(args)):
                trips.append(name)
            return await original(*args, **kwargs)

        return call

    perform = base.perform

    async def performing(*args: Any) -> None:
        state = {"open": True}
        window.set(state)
        acking["now"] = True
        try:
            await perform(*args)
        finally:
            state["open"] = False
            acking["now"] = False

    monkeypatch.setattr(base, "perform", performing)
    monkeypatch.setattr(Pool, "call", counting(Pool.call, "wire"))
    monkeypatch.setattr(Redis, "execute_command", counting(Redis.execute_command, "redis"))
    monkeypatch.setattr(Pipeline, "execute", counting(Pipeline.execute, "pipeline"))
    c = await keel(echo_agent())
    thread = "1700000090.000100"
    await post_event(c, event_body(f"<@{BOT}> wipe a", ts=thread))  # a new conversation
    assert trips == ["wire"]
    await slack.until(lambda s: any(m.blocks for m in s.posts(thread)))
    trips.clear()
    await post_event(c, event_body("in the thread", ts="1700000091.000100", kind="message", thread_ts=thread))
    assert trips == ["wire"]
    (ask,) = [m for m in slack.posts(thread) if m.blocks]
    trips.clear()
    assert (await click(c, click_body(ask, "approve"))).status_code == 200
    assert trips == ["wire"]
    await slack.until(lambda s: any(m.text == "done: wiped a" for m in s.posts(thread)))


async def test_two_processes_deliver_each_reply_once_in_order(keel: Any, slack: FakeSlack) -> None:
    """Both run turns and relays on one Redis; a conversation's messages arrive at either."""
    a, b = await keel(echo_agent()), await keel(echo_agent())
    threads = [f"1700002000.{n:06d}" for n in range(20)]
    await asyncio.gather(
        *(post_event((a, b)[n % 2], event_body(f"<@{BOT}> t{n}", ts=t)) for n, t in enumerate(threads))
    )
    for k in range(3):  # each thread's follow-ups, one after another, alternating processes
        await asyncio.gather(
            *(
                post_event(
                    (b, a)[(n + k) % 2],
                    event_body(f"f{k}", ts=f"1700002001.{n:04d}{k:02d}", kind="message", thread_ts=t),
                )
                for n, t in enumerate(threads)
            )
        )
    await slack.until(lambda s: len(s.posts()) >= 80, timeout=60)
    for n, t in enumerate(threads):
        assert replies(slack, t) == [f"re:t{n}", "re:f0", "re:f1", "re:f2"]


# ---- payloads of the wrong shape, signed -----------------------------------------------------

DEEP = "[" * 5000 + "]" * 5000  # deeper than any decoder recurses


def odd_event(**changes: Any) -> bytes:
    """A mention that keel would answer, its event changed by `changes`; a change keyed
    `envelope.<name>` changes the envelope instead."""
    envelope = json.loads(event_body(f"<@{BOT}> odd", ts="1700000080.000100"))
    for name, value in changes.items():
        if name.startswith("envelope."):
            envelope[name.removeprefix("envelope.")] = value
        else:
            envelope["event"][name] = value
    return json.dumps(envelope).encode().replace(b'"<deep>"', DEEP.encode())


def odd_click(**changes: Any) -> bytes:
    """An approve click (on a request that does not exist), changed by `changes`; a change keyed
    `action.<name>` changes the button's action instead."""
    value = '{"s": "ses_x", "r": "req_x", "a": "U0ALICE"}'
    action = {"action_id": "keel_approve", "block_id": "b", "value": value, "type": "button", "action_ts": "1.2"}
    payload: dict[str, Any] = {
        "type": "block_actions",
        "team": {"id": TEAM, "domain": "test"},
        "user": {"id": "U0ALICE", "team_id": TEAM},
        "container": {"type": "message", "message_ts": "1700000081.000100", "channel_id": "C0GENERAL"},
        "channel": {"id": "C0GENERAL"},
        "message": {"ts": "1700000081.000100", "thread_ts": "1700000080.000100", "text": "ask"},
        "actions": [action],
    }
    for name, value in changes.items():
        if name.startswith("action."):
            action[name.removeprefix("action.")] = value
        else:
            payload[name] = value
    return urlencode({"payload": json.dumps(payload).replace('"<deep>"', DEEP)}).encode()


WRONG_EVENTS = {
    "subtype a list": odd_event(subtype=["x"]),
    "subtype an object": odd_event(subtype={"x": 1}),
    "authorizations a number": odd_event(**{"envelope.authorizations": 5}),
    "an authorization a string": odd_event(**{"envelope.authorizations": ["x"]}),
    "is_bot a string": odd_event(**{"envelope.authorizations": [{"user_id": BOT, "is_bot": "yes"}]}),
    "text a list": odd_event(text=["<@U0BOT> odd"]),
    "text a number": odd_event(text=5),
    "user a list": odd_event(user=["U0ALICE"]),
    "channel an object": odd_event(channel={"id": "C0GENERAL"}),
    "ts a number": odd_event(ts=1700000080.0001),
    "thread_ts a number": odd_event(thread_ts=1700000080.0001),
    "channel_type a bool": odd_event(channel_type=True),
    "bot_id a list": odd_event(bot_id=[]),
    "team_id a number": odd_event(**{"envelope.team_id": 7}),
    "the event a list": odd_event(**{"envelope.event": []}),
    "the event's type a list": odd_event(type=["app_mention"]),
    "the envelope's type null": odd_event(**{"envelope.type": None}),
    "the event nested too deeply": odd_event(text="<deep>"),
    "not an object": b"[1, 2]",
    "not JSON": b"{",
    "a challenge that is not a string": json.dumps({"type": "url_verification", "challenge": 5}).encode(),
}
WRONG_CLICKS = {
    "team a string": odd_click(team="T0TEAM"),
    "user a list": odd_click(user=["U0ALICE"]),
    "actions an object": odd_click(actions={"0": {}}),
    "actions a number": odd_click(actions=5),
    "an action a string": odd_click(actions=["keel_approve"]),
    "action_id a list": odd_click(**{"action.action_id": ["keel_approve"]}),
    "value a number": odd_click(**{"action.value": 5}),
    "value not an object": odd_click(**{"action.value": "[1]"}),
    "value names no request": odd_click(**{"action.value": '{"s": "ses_x", "r": 5}'}),
    "channel a string": odd_click(channel="C0GENERAL"),
    "message a list": odd_click(message=[]),
    "container a number": odd_click(container=1),
    "nested too deeply": odd_click(message="<deep>"),
    "no payload field": urlencode({"other": "{}"}).encode(),
    "a payload that is not an object": urlencode({"payload": "5"}).encode(),
}


@pytest.mark.parametrize("body", WRONG_EVENTS.values(), ids=WRONG_EVENTS.keys())
async def test_a_signed_event_of_the_wrong_shape_is_400_and_writes_nothing(
    keel: Any, slack: FakeSlack, redis: Redis, body: bytes
) -> None:
    c = await keel(echo_agent())
    before = await redis.dbsize()
    r = await post_event(c, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_payload"
    assert await redis.dbsize() == before
    assert not await redis.exists(f"keel:{{{session_for(TEAM, 'C0GENERAL', '1700000080.000100')}}}:meta")
    assert slack.count("chat.postMessage") == 0


@pytest.mark.parametrize("body", WRONG_CLICKS.values(), ids=WRONG_CLICKS.keys())
async def test_a_signed_click_of_the_wrong_shape_is_400_and_writes_nothing(
    keel: Any, slack: FakeSlack, redis: Redis, body: bytes
) -> None:
    c = await keel(echo_agent())
    before = await redis.dbsize()
    r = await click(c, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_payload"
    assert await redis.dbsize() == before
    assert slack.ephemerals == []


# what Slack really sends that keel does not act on: other events, whose fields of the same
# names hold other types, envelopes of other kinds, messages with every field Slack adds
SLACK_SENDS = {
    "user_change (its user an object)": json.dumps(
        {
            "type": "event_callback",
            "team_id": TEAM,
            "event": {"type": "user_change", "user": {"id": "U0ALICE", "profile": {"real_name": "A"}}},
            "authorizations": [{"enterprise_id": None, "team_id": TEAM, "user_id": BOT, "is_bot": True}],
        }
    ).encode(),
    "channel_created (its channel an object)": json.dumps(
        {
            "type": "event_callback",
            "team_id": TEAM,
            "event": {"type": "channel_created", "channel": {"id": "C0NEW", "name": "new", "created": 1}},
        }
    ).encode(),
    "reaction_added": json.dumps(
        {
            "type": "event_callback",
            "team_id": TEAM,
            "event": {
                "type": "reaction_added",
                "user": "U0ALICE",
                "reaction": "thumbsup",
                "item": {"type": "message", "channel": "C0GENERAL", "ts": "1700000082.000100"},
                "event_ts": "1700000082.000200",
            },
        }
    ).encode(),
    "message_changed (no user, a nested message)": odd_event(
        type="message",
        subtype="message_changed",
        user=None,
        hidden=True,
        message={"type": "message", "user": "U0ALICE", "text": f"<@{BOT}> edited", "ts": "1700000080.000100"},
        previous_message={"type": "message", "user": "U0ALICE", "text": "before"},
    ),
    "bot_message (bot_profile, no user)": odd_event(
        type="message", subtype="bot_message", bot_id="B0OTHER", bot_profile={"id": "B0OTHER"}, username="bot"
    ),
    "app_rate_limited": json.dumps(
        {"token": "t", "type": "app_rate_limited", "team_id": TEAM, "minute_rate_limited": 1518467820}
    ).encode(),
}


@pytest.mark.parametrize("body", SLACK_SENDS.values(), ids=SLACK_SENDS.keys())
async def test_what_slack_sends_and_keel_ignores_is_200(keel: Any, slack: FakeSlack, redis: Redis, body: bytes) -> None:
    c = await keel(echo_agent())
    before = await redis.dbsize()
    r = await post_event(c, body)
    assert r.status_code == 200 and r.content == b""
    assert await redis.dbsize() == before


async def test_a_message_with_every_field_slack_adds_is_answered(keel: Any, slack: FakeSlack) -> None:
    c = await keel(echo_agent())
    thread = "1700000083.000100"
    envelope = json.loads(event_body(f"<@{BOT}> all of it", ts=thread))
    envelope.update(
        is_ext_shared_channel=False,
        context_team_id=TEAM,
        context_enterprise_id=None,
        event_context="4-eyJldCI6ImFwcF9tZW50aW9uIn0",
        authorizations=[
            {"enterprise_id": None, "team_id": TEAM, "user_id": BOT, "is_bot": True, "is_enterprise_install": False}
        ],
    )
    envelope["event"].update(
        client_msg_id="5f7a3c2e-0000-4000-8000-000000000000",
        team=TEAM,
        blocks=[{"type": "rich_text", "block_id": "x", "elements": [{"type": "rich_text_section", "elements": []}]}],
        files=[{"id": "F1", "name": "a.txt"}],
        attachments=[{"fallback": "x"}],
        edited={"user": "U0ALICE", "ts": "1700000083.000200"},
        user_team=TEAM,
        source_team=TEAM,
        user_profile={"name": "alice", "is_restricted": False},
    )
    r = await post_event(c, json.dumps(envelope).encode())
    assert r.status_code == 200
    await slack.until(lambda s: len(s.posts(thread)) == 1)
    assert replies(slack, thread) == ["re:all of it"]


async def test_clicks_keel_does_not_act_on_are_200(keel: Any, slack: FakeSlack, redis: Redis) -> None:
    c = await keel(echo_agent())
    before = await redis.dbsize()
    others = [
        odd_click(**{"action.action_id": "someone_elses", "action.value": None}),  # another app's button
        odd_click(actions=[{"action_id": "pick", "type": "static_select", "selected_option": {"value": "a"}}]),
        odd_click(actions=[]),
        odd_click(team=None),  # an organization-wide install
        urlencode(
            {"payload": json.dumps({"type": "view_submission", "team": {"id": TEAM}, "view": {"state": {}}})}
        ).encode(),
        urlencode({"payload": json.dumps({"type": "shortcut", "callback_id": "x", "user": "U0ALICE"})}).encode(),
    ]
    for body in others:
        assert (await click(c, body)).status_code == 200
    assert await redis.dbsize() == before

"""The Linear channel against a local server that speaks Linear's GraphQL API, with webhooks
signed as Linear signs them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from channels.webhooks.linear import session_for
from harness import Agent
from harness.models import ModelReply, ModelRequest, ScriptedModel
from tests.channels.linear_server import API_KEY, SECRET, FakeLinear, created, prompted, signed
from tests.channels.slack_support import echo_agent

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def keel(serve: Any, linear: FakeLinear) -> AsyncIterator[Any]:
    clients: list[httpx.AsyncClient] = []

    async def start(agent: Agent, **settings: Any) -> httpx.AsyncClient:
        live = await serve(
            agent,
            linear_webhook_secret=SECRET,
            linear_api_key=API_KEY,
            linear_api_url=linear.url,
            lease_ms=1000,
            **settings,
        )
        clients.append(live.client())
        return clients[-1]

    yield start
    for c in clients:
        await c.aclose()


async def hook(c: httpx.AsyncClient, body: bytes, **kw: Any) -> httpx.Response:
    return await c.post("/v1/linear/webhook", content=body, headers=signed(body, **kw))


async def test_created_gets_a_thought_then_a_response(keel: Any, linear: FakeLinear, redis: Redis) -> None:
    seen: list[ModelRequest] = []

    def script(r: ModelRequest) -> ModelReply:
        seen.append(r)
        return ModelReply(text=f"re:{r.messages[-1].text}")

    c = await keel(Agent(instructions="t", model=ScriptedModel(script)))
    r = await hook(c, created("as-1", context="Issue ENG-1: the build is red"))
    assert r.status_code == 200
    await linear.until(lambda s: "response" in s.kinds("as-1"))
    thought, response = linear.of("as-1")
    assert thought.content == {"type": "thought", "body": "Working on it…"} and thought.ephemeral
    assert response.content == {"type": "response", "body": "re:@keel please help"}
    # the prompt context is keyed page context: in the model's request, never in history
    assert any("the build is red" in m.text for m in seen[0].messages)
    await hook(c, prompted("as-1", "act-2", "and now?"))
    await linear.until(lambda s: s.kinds("as-1").count("response") == 2)
    sid = session_for("as-1")
    history = await redis.lrange(f"keel:{{{sid}}}:history", 0, -1)
    assert history and not any(b"the build is red" in item for item in history)
    assert any("the build is red" in m.text for m in seen[1].messages)  # still seen, the newest


async def test_redeliveries_and_replays_are_one_message(keel: Any, linear: FakeLinear) -> None:
    c = await keel(echo_agent())
    body = created("as-2")
    for _ in range(3):  # Linear's retries come with a new Linear-Delivery, the same body
        assert (await hook(c, body)).status_code == 200
    again = prompted("as-2", "act-9", "more")
    assert (await hook(c, again)).status_code == 200
    assert (await hook(c, again, delivery="replayed")).status_code == 200
    await hook(c, prompted("as-2", "act-10", "last"))
    await linear.until(lambda s: s.kinds("as-2").count("response") >= 3)
    responses = [a.content["body"] for a in linear.of("as-2") if a.content["type"] == "response"]
    assert responses == ["re:@keel please help", "re:more", "re:last"]


async def test_bad_signatures_and_stale_timestamps_are_401_and_write_nothing(
    keel: Any, linear: FakeLinear, redis: Redis
) -> None:
    c = await keel(echo_agent())
    before = await redis.dbsize()
    body = created("as-3")
    cases = [
        await c.post("/v1/linear/webhook", content=body, headers=signed(body, secret="wrong")),
        await c.post("/v1/linear/webhook", content=body.replace(b"ENG-1", b"ENG-2"), headers=signed(body)),
        await c.post("/v1/linear/webhook", content=body, headers={"Content-Type": "application/json"}),
        await hook(c, created("as-3", at_ms=(time.time() - 61) * 1000)),  # signed, but stale
    ]
    for r in cases:
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_signature"
    assert await redis.dbsize() == before
    assert linear.requests == 0


async def test_stop_cancels_the_turn_and_ends_with_a_response(keel: Any, linear: FakeLinear) -> None:
    gates = {"hello": asyncio.Event(), "go on": asyncio.Event()}

    async def script(r: ModelRequest) -> ModelReply:
        text = r.messages[-1].text
        await gates.get(text, gates["hello"]).wait()
        return ModelReply(text=f"re:{text}")

    c = await keel(Agent(instructions="t", model=ScriptedModel(script)))
    await hook(c, created("as-4", comment="hello"))
    await linear.until(lambda s: "thought" in s.kinds("as-4"))
    assert (await hook(c, prompted("as-4", "act-stop", "Stop", signal="stop"))).status_code == 200
    await linear.until(lambda s: "response" in s.kinds("as-4"))
    assert linear.of("as-4")[-1].content == {"type": "response", "body": "Stopped."}
    await hook(c, prompted("as-4", "act-next", "go on"))  # a new turn, waiting on its model ...
    await linear.until(lambda s: s.kinds("as-4").count("thought") == 2)
    stop_again = prompted("as-4", "act-stop", "Stop", signal="stop")
    assert (await hook(c, stop_again)).status_code == 200  # ... and the first stop, redelivered
    gates["go on"].set()
    await linear.until(lambda s: s.kinds("as-4").count("response") == 2)
    assert linear.of("as-4")[-1].content == {"type": "response", "body": "re:go on"}  # not stopped


async def test_an_elicitation_answered_runs_the_tool_once(keel: Any, linear: FakeLinear) -> None:
    ran: list[str] = []
    c = await keel(echo_agent(ran))
    await hook(c, created("as-5", comment="wipe disk"))
    await linear.until(lambda s: "elicitation" in s.kinds("as-5"))
    ask = next(a for a in linear.of("as-5") if a.content["type"] == "elicitation")
    assert "wipe" in ask.content["body"] and ask.signal == "select"
    assert ask.signal_metadata == {"options": [{"value": "Approve"}, {"value": "Deny"}]}
    assert ran == []
    await hook(c, prompted("as-5", "act-yes", "Approve"))
    await hook(c, prompted("as-5", "act-yes", "Approve"))  # redelivered: one answer
    await linear.until(lambda s: "response" in s.kinds("as-5"))
    assert ran == ["disk"]
    kinds = linear.kinds("as-5")
    assert kinds.count("action") == 2  # the tool started (ephemeral), then its result
    result = [a for a in linear.of("as-5") if a.content["type"] == "action"][-1]
    assert result.content["result"] == "wiped disk"
    assert linear.of("as-5")[-1].content == {"type": "response", "body": "done: wiped disk"}


async def test_a_deny_in_words_answers_and_a_later_approve_is_a_message(keel: Any, linear: FakeLinear) -> None:
    ran: list[str] = []
    c = await keel(echo_agent(ran))
    await hook(c, created("as-6", comment="wipe tmp"))
    await linear.until(lambda s: "elicitation" in s.kinds("as-6"))
    await hook(c, prompted("as-6", "act-no", "deny, not today"))
    await linear.until(lambda s: "response" in s.kinds("as-6"))
    assert ran == []
    await hook(c, prompted("as-6", "act-ok", "ok"))  # nothing waits: an ordinary message
    await linear.until(lambda s: s.kinds("as-6").count("response") == 2)
    assert linear.of("as-6")[-1].content["body"] == "re:ok"


async def test_a_session_keel_cannot_take_gets_an_error_activity(keel: Any, linear: FakeLinear) -> None:
    c = await keel(echo_agent())
    await hook(c, created("as-7"))
    await linear.until(lambda s: "response" in s.kinds("as-7"))
    other_org = created("as-7").replace(b'"organizationId": "org-1"', b'"organizationId": "org-2"')
    assert b"org-2" in other_org
    assert (await hook(c, other_org)).status_code == 200  # (not this organization's session)
    await linear.until(lambda s: "error" in s.kinds("as-7"))
    assert "could not take this session" in linear.of("as-7")[-1].content["body"]


async def test_a_prompt_past_the_queue_gets_an_error_activity(keel: Any, linear: FakeLinear) -> None:
    """A follow-up refused as queue_full is said so in the agent session (it was dropped
    unsaid); the ones taken are answered."""
    gate = asyncio.Event()
    c = await keel(echo_agent(gate=gate), max_queued=1)
    await hook(c, created("as-9", comment="first"))
    await linear.until(lambda s: "thought" in s.kinds("as-9"))  # (its turn runs, held at the gate)
    assert (await hook(c, prompted("as-9", "act-2", "second"))).status_code == 200  # (steered into it)
    assert (await hook(c, prompted("as-9", "act-3", "third"))).status_code == 200  # (past the queue)
    # (an approval's words with nothing waiting are a message too: refused the same way)
    assert (await hook(c, prompted("as-9", "act-4", "ok"))).status_code == 200
    await linear.until(lambda s: s.kinds("as-9").count("error") == 2)
    for refused in (a for a in linear.of("as-9") if a.content["type"] == "error"):
        assert "could not take this message" in refused.content["body"] and "wait" in refused.content["body"]
    gate.set()
    await linear.until(lambda s: "response" in s.kinds("as-9"))
    assert all("third" not in str(a.content) for a in linear.of("as-9") if a.content["type"] == "response")


async def test_a_failed_turn_is_an_error_activity(keel: Any, linear: FakeLinear) -> None:
    from harness.errors import ModelError

    def script(r: ModelRequest) -> ModelReply:
        raise ModelError("the key was revoked", code="model_auth")

    c = await keel(Agent(instructions="t", model=ScriptedModel(script)))
    await hook(c, created("as-8"))
    await linear.until(lambda s: "error" in s.kinds("as-8"))
    assert linear.kinds("as-8") == ["thought", "error"]
    assert "the key was revoked" in linear.of("as-8")[-1].content["body"]


# ---- payloads of the wrong shape, signed -----------------------------------------------------


def odd(body: bytes, **changes: Any) -> bytes:
    """`body` (a webhook) changed by `changes`, at `a.b` paths; the value "<deep>" is nested
    deeper than any decoder recurses."""
    payload = json.loads(body)
    for path, value in changes.items():
        *parents, name = path.split(".")
        node = payload
        for parent in parents:
            node = node[parent]
        node[name] = value
    return json.dumps(payload).encode().replace(b'"<deep>"', b"[" * 5000 + b"]" * 5000)


def fresh(body: bytes) -> bytes:
    """`body` stamped now (the cases are made at collection, which may be minutes before)."""
    stamp = b'"webhookTimestamp": '
    at = body.index(stamp) + len(stamp)
    end = at + len(body[at:].split(b",", 1)[0].split(b"}", 1)[0])
    return body[:at] + str(int(time.time() * 1000)).encode() + body[end:]


WRONG = {
    "agentSession a string": odd(created("as-w"), agentSession="str"),
    "agentSession null": odd(created("as-w"), agentSession=None),
    "agentSession's id a number": odd(created("as-w"), **{"agentSession.id": 5}),
    "comment a string": odd(created("as-w"), **{"agentSession.comment": "str"}),
    "comment's body a list": odd(created("as-w"), **{"agentSession.comment.body": ["hi"]}),
    "issue a list": odd(created("as-w"), **{"agentSession.issue": []}),
    "issue's identifier a number": odd(created("as-w"), **{"agentSession.issue.identifier": 1}),
    "creator a string": odd(created("as-w"), **{"agentSession.creator": "user-alice"}),
    "creator's id an object": odd(created("as-w"), **{"agentSession.creator.id": {}}),
    "organizationId a number": odd(created("as-w"), organizationId=5),
    "promptContext a list": odd(created("as-w"), promptContext=["Issue ENG-1"]),
    "action a list": odd(created("as-w"), action=["created"]),
    "type a number": odd(created("as-w"), type=1),
    "agentActivity a string": odd(prompted("as-w", "act-w", "hi"), agentActivity="str"),
    "agentActivity's id a number": odd(prompted("as-w", "act-w", "hi"), **{"agentActivity.id": 5}),
    "agentActivity's user a string": odd(prompted("as-w", "act-w", "hi"), **{"agentActivity.user": "user-alice"}),
    "agentActivity's userId a list": odd(prompted("as-w", "act-w", "hi"), **{"agentActivity.userId": []}),
    "content a string": odd(prompted("as-w", "act-w", "hi"), **{"agentActivity.content": "hi"}),
    "content's body an object": odd(prompted("as-w", "act-w", "hi"), **{"agentActivity.content.body": {}}),
    "signal a list": odd(prompted("as-w", "act-w", "hi"), **{"agentActivity.signal": ["stop"]}),
}


@pytest.mark.parametrize("body", WRONG.values(), ids=WRONG.keys())
async def test_a_signed_payload_of_the_wrong_shape_is_400_and_writes_nothing(
    keel: Any, linear: FakeLinear, redis: Redis, body: bytes
) -> None:
    c = await keel(echo_agent())
    before = await redis.dbsize()
    r = await hook(c, fresh(body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_payload"
    assert await redis.dbsize() == before
    assert linear.requests == 0


async def test_a_signed_body_whose_timestamp_cannot_be_read_is_401(keel: Any, redis: Redis) -> None:
    """Freshness is part of the signature's check: a body keel cannot read the timestamp of
    (not JSON, not an object, nested too deeply, no number) is not known to be fresh."""
    c = await keel(echo_agent())
    before = await redis.dbsize()
    unreadable = [
        b"[1]",
        b"{",
        b'{"type": "AgentSessionEvent"}',
        json.dumps({"webhookTimestamp": str(int(time.time() * 1000))}).encode(),
        odd(created("as-w"), **{"agentSession.issue.title": "<deep>"}),
    ]
    for body in unreadable:
        r = await hook(c, body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_signature"
    assert await redis.dbsize() == before


async def test_what_linear_sends_is_taken_with_every_field_it_adds(keel: Any, linear: FakeLinear, redis: Redis) -> None:
    c = await keel(echo_agent())
    now = int(time.time() * 1000)
    before = await redis.dbsize()
    # other webhooks to the same address: taken, ignored
    for other in (
        {"type": "Issue", "action": "update", "data": {"id": "i-1", "title": "x"}, "organizationId": "org-1"},
        {"type": "AppUserNotification", "action": "issueMention", "notification": {"id": "n-1"}},
        {"type": "OAuthApp", "action": "revoked", "oauthClientId": "client-1"},
        {"type": "AgentSessionEvent", "action": "updated", "agentSession": {"id": "as-9"}, "organizationId": "org-1"},
    ):
        assert (await hook(c, json.dumps({**other, "webhookTimestamp": now}).encode())).status_code == 200
    assert await redis.dbsize() == before and linear.requests == 0
    # a session made with everything Linear sends, no comment, no creator
    body = odd(
        created("as-11"),
        **{
            "agentSession.comment": None,
            "agentSession.creator": None,
            "agentSession.status": "pending",
            "agentSession.sourceMetadata": None,
            "agentSession.issue.team": {"id": "team-1", "key": "ENG"},
            "agentSession.appUser": {"id": "app-user-1", "name": "keel"},
            "previousComments": [{"id": "c-0", "body": "earlier", "userId": "user-bob"}],
            "guidance": [{"body": "be brief", "origin": {"__typename": "TeamGuidance"}}],
        },
    )
    assert (await hook(c, body)).status_code == 200
    await linear.until(lambda s: "response" in s.kinds("as-11"))
    assert linear.of("as-11")[-1].content == {"type": "response", "body": "re:Please work on this issue."}
    # a prompt with the activity's every field
    prompt = odd(
        prompted("as-11", "act-11", "more please"),
        **{
            "agentActivity.user": {"id": "user-alice", "name": "Alice"},
            "agentActivity.agentSessionId": "as-11",
            "agentActivity.sourceCommentId": "c-2",
            "agentActivity.signalMetadata": None,
            "agentActivity.content.extra": {"x": [1]},
        },
    )
    assert (await hook(c, prompt)).status_code == 200
    await linear.until(lambda s: s.kinds("as-11").count("response") == 2)
    assert linear.of("as-11")[-1].content == {"type": "response", "body": "re:more please"}


async def test_a_prompt_with_the_id_of_an_earlier_stop_is_not_a_500(keel: Any, linear: FakeLinear) -> None:
    """A stop is kept by its activity's id, a message by its own: the same id on both (never so
    from Linear, but signed all the same) is a stop, then a message, not an error."""
    c = await keel(echo_agent())
    await hook(c, created("as-12"))
    await linear.until(lambda s: "response" in s.kinds("as-12"))
    assert (await hook(c, prompted("as-12", "act-12", "Stop", signal="stop"))).status_code == 200
    assert (await hook(c, prompted("as-12", "act-12", "go on"))).status_code == 200
    await linear.until(lambda s: s.kinds("as-12").count("response") == 2)
    assert linear.of("as-12")[-1].content == {"type": "response", "body": "re:go on"}

"""OpenTelemetry traces across processes, received by an OTLP/HTTP receiver (tests/otlp_receiver.py)
the way a collector would: a web process (no turns) and a worker process, both exporting. A
message sent with the client's `traceparent` gives one trace: the client's span, the web
process's server span, and the worker's `invoke_agent`, `chat` (per model attempt) and
`execute_tool` spans with the GenAI attributes; a worker killed mid-turn and the one that takes the
turn over keep it in the same trace; no message or tool content without KEEL_TRACE_CONTENT."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from app.logs import Redactor
from harness.telemetry import tracing
from harness.telemetry.tracing import TRACEPARENT as TRACEPARENT_RE
from tests.channels.slack_server import BOT, SECRET, TOKEN, FakeSlack, event_body
from tests.channels.slack_support import echo_agent, post_event, relay_done
from tests.channels.webhook_receiver import Receiver as WebhookReceiver
from tests.conftest import ValkeyServer, free_port
from tests.otlp_receiver import Receiver, Span
from tests.service import EventTail, Service, Worker

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
SERVER = 2  # SpanKind SERVER in OTLP
CONTENT_KEYS = ("gen_ai.tool.call.arguments", "gen_ai.tool.call.result", "gen_ai.output.messages")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.start()
    yield r
    r.stop()


@pytest.fixture
def processes(valkey: ValkeyServer, tmp_path: Path, receiver: Receiver) -> Iterator[tuple[Service, Any]]:
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    common = {"KEEL_AGENT": "tests.crash_agent:slow", "KEEL_LEASE_MS": "1000", "KEEL_TEST_LOG": str(tmp_path / "calls")}
    web = Service(tmp_path, free_port(), REDIS_URL=valkey.url, KEEL_RUN_TURNS="0", **common, **otel)
    workers: list[Worker] = []

    def worker() -> Worker:
        w = Worker(tmp_path, valkey.url, **common, **otel)
        w.start()
        workers.append(w)
        return w

    web.start()
    yield web, worker
    for w in workers:
        w.stop()
    web.stop()


def one(spans: list[Span]) -> Span:
    assert len(spans) == 1, [(s.name, s.service) for s in spans]
    return spans[0]


async def test_a_turn_is_one_trace_from_the_request_through_the_worker(
    processes: tuple[Service, Any], receiver: Receiver
) -> None:
    web, worker = processes
    worker()
    async with httpx.AsyncClient(base_url=web.base, timeout=30) as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(
            f"/v1/sessions/{sid}/messages?wait=true&timeout=20",
            json={"text": "hold 0.05", "message_id": "m-1"},
            headers={"traceparent": TRACEPARENT},
        )
        assert r.json()["status"] == "completed", r.text
    agent = one(await receiver.until("invoke_agent"))
    chats = await receiver.until("chat ", 2)
    tool = one(await receiver.until("execute_tool"))
    posts = [s for s in await receiver.until("POST /v1/sessions/{id}/messages") if s.trace_id == CLIENT_TRACE]
    server = one(posts)

    # one trace: the client's span > the web's server span > the worker's turn > its calls
    assert {s.trace_id for s in (server, agent, tool, *chats)} == {CLIENT_TRACE}
    assert server.parent_id == CLIENT_SPAN and server.kind == SERVER and server.service == "keel"
    assert server.attributes["http.response.status_code"] == 200
    assert agent.parent_id == server.span_id and agent.service == "keel-worker"
    assert agent.name == "invoke_agent agent"
    assert agent.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert agent.attributes["gen_ai.conversation.id"] == sid
    assert agent.attributes["keel.message.id"] == "m-1" and agent.attributes["keel.turn.id"].startswith("turn_")
    for chat in chats:
        assert chat.parent_id == agent.span_id and chat.name == "chat scripted"
        assert chat.attributes["gen_ai.operation.name"] == "chat"
        assert chat.attributes["gen_ai.provider.name"] == "keel.scripted"
        assert chat.attributes["gen_ai.request.model"] == "scripted"
        assert chat.attributes["gen_ai.usage.input_tokens"] > 0
        assert "gen_ai.usage.output_tokens" in chat.attributes
        assert "gen_ai.usage.cache_read.input_tokens" in chat.attributes
    assert tool.parent_id == agent.span_id and tool.name == "execute_tool hold"
    assert tool.attributes["gen_ai.tool.name"] == "hold"
    assert tool.attributes["gen_ai.tool.call.id"].startswith("call_")
    # no content without KEEL_TRACE_CONTENT
    for span in (server, agent, tool, *chats):
        assert not any(k in span.attributes for k in CONTENT_KEYS), span.attributes


async def test_a_turn_taken_over_after_a_crash_stays_in_its_trace(
    processes: tuple[Service, Any], receiver: Receiver
) -> None:
    web, worker = processes
    first = worker()
    async with httpx.AsyncClient(base_url=web.base, timeout=30) as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        tail = EventTail(web.base, sid)
        tail.start()
        try:
            r = await c.post(
                f"/v1/sessions/{sid}/messages", json={"text": "hold 3"}, headers={"traceparent": TRACEPARENT}
            )
            assert r.status_code == 202
            await tail.wait_for("tool.started")
            first.kill9()  # mid-tool: its turn's spans never end, never leave
            worker()  # takes the turn over once the lease lapses
            await tail.wait_for("turn.completed")
        finally:
            await tail.stop()
    server = one([s for s in await receiver.until("POST /v1/sessions/{id}/messages") if s.trace_id == CLIENT_TRACE])
    resumed = one(await receiver.until("invoke_agent"))
    assert resumed.trace_id == CLIENT_TRACE and resumed.parent_id == server.span_id
    assert resumed.attributes["keel.turn.took_over"] is True
    tool = one(await receiver.until("execute_tool hold"))  # the tool run again by the second worker
    assert tool.trace_id == CLIENT_TRACE and tool.parent_id == resumed.span_id


@pytest.fixture
def traced(receiver: Receiver) -> Iterator[None]:
    """Tracing on in this process (the `serve` fixture's keel), exporting to the receiver."""
    assert tracing.configure({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})
    yield
    tracing.shutdown()


async def test_deliveries_carry_the_traceparent_of_their_span(
    traced: None, serve: Any, redis: Redis, slack: FakeSlack, receiver: Receiver
) -> None:
    """An event webhook's delivery and Slack's posts carry the `deliver` span's traceparent."""
    hooks = WebhookReceiver()
    hooks.start()
    try:
        live = await serve(echo_agent(), webhook_allow_private=True)
        async with live.client() as c:
            r = await c.post("/v1/webhooks", json={"url": hooks.url("all"), "events": ["*"]})
            hooks.expect("all", r.json()["secret"])
            sid = (await c.post("/v1/sessions")).json()["session_id"]
            r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hi"})
            assert r.json()["status"] == "completed"
            await relay_done(redis)
        assert hooks.traceparents and all(TRACEPARENT_RE.match(t) for t in hooks.traceparents)
        assert len({t.split("-")[2] for t in hooks.traceparents}) == len(hooks.traceparents)  # a span each
    finally:
        hooks.stop()
    slack_live = await serve(
        echo_agent(), slack_signing_secret=SECRET, slack_bot_token=TOKEN, slack_api_url=slack.url, lease_ms=1000
    )
    async with slack_live.client() as c:
        assert (await post_event(c, event_body(f"<@{BOT}> hello", ts="1700000001.000100"))).status_code == 200
        await slack.until(lambda s: len(s.posts("1700000001.000100")) == 1)
    assert slack.traceparents and all(TRACEPARENT_RE.match(t) for t in slack.traceparents)


async def test_content_only_with_the_setting_and_redacted(serve: Any, receiver: Receiver) -> None:
    """KEEL_TRACE_CONTENT=1: the reply, a tool's arguments and its result are on the spans, with
    the secrets the logs redact redacted."""
    secret = "sk-test-0123456789abcdef"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "KEEL_TRACE_CONTENT": "1"}
    assert tracing.configure(env, redact=Redactor([secret]))
    try:
        live = await serve(echo_agent())
        async with live.client() as c:
            sid = (await c.post("/v1/sessions")).json()["session_id"]
            r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": f"wipe {secret}"})
            assert r.json()["status"] == "waiting"
            (request,) = (await c.get(f"/v1/sessions/{sid}")).json()["pending"]
            body = {"request_id": request["request_id"], "decision": "approve"}
            async with asyncio.timeout(10), c.stream("GET", f"/v1/sessions/{sid}/events") as events:
                assert (await c.post(f"/v1/sessions/{sid}/responses", json=body)).status_code == 202
                async for line in events.aiter_lines():  # (until the turn, resumed, is done)
                    if line == "event: turn.completed":
                        break
    finally:
        tracing.shutdown()  # (what is left is exported)
    tool = one(await receiver.until("execute_tool wipe"))
    assert tool.attributes["gen_ai.tool.call.arguments"] == '{"target":"[redacted]"}'
    assert tool.attributes["gen_ai.tool.call.result"] == "wiped [redacted]"
    replies = [s.attributes.get("gen_ai.output.messages") for s in await receiver.until("chat ", 2)]
    assert "done: wiped [redacted]" in replies
    assert not any(secret in str(s.attributes) for s in receiver.spans)

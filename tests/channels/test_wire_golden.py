"""keel's wire output, byte for byte, against a recording: one scripted conversation that emits
every event type (a tool, an approval granted, one denied, one withdrawn by a cancel, a failed
turn, an automatic and a manual compaction, a clear, a duplicate message, streamed replies, the
session's deletion), read as SSE, as `?wait=true` answers and as event webhook bodies, with ids
and times masked (each id by its order of first appearance, so a changed id structure shows).

The recording (`golden/conversation.txt`) was made from the code before the harness moved into
its rooms (issue 22); a change of keel's wire bytes fails this test. Record it again, knowingly,
with `KEEL_GOLDEN_RECORD=1`."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import httpx

from harness import Agent, Compaction, tool
from harness.errors import ModelError
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall, Usage
from tests.channels.linear_server import API_KEY, created, prompted
from tests.channels.linear_server import SECRET as LINEAR_SECRET
from tests.channels.linear_server import signed as linear_signed
from tests.channels.slack_server import BOT, SECRET, TOKEN, click_body, event_body
from tests.channels.slack_support import click, post_event
from tests.channels.webhook_receiver import Receiver

GOLDEN = Path(__file__).parent / "golden" / "conversation.txt"
BIG = "tell me about " + "lamps and desks " * 400  # past the context window's threshold: compacts


def golden_agent() -> Agent:
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool(approval=True)
    def place_order(item: str) -> str:
        """Order an item (asks a person first)."""
        return f"ordered {item}"

    def script(r: ModelRequest) -> ModelReply:
        if r.purpose == "compaction":
            return ModelReply(text="the user asked about sums and orders", usage=Usage(40, 9))
        last = r.messages[-1]
        if last.role == "tool":
            return ModelReply(text=f"The tool says: {last.text}", usage=Usage(60, 6, cached_tokens=32))
        text = last.text
        if text.startswith("add "):
            a, b = text.split()[1:3]
            return ModelReply(tool_calls=[ToolCall("add", {"a": int(a), "b": int(b)})], usage=Usage(50, 8))
        if text.startswith("order "):
            return ModelReply(tool_calls=[ToolCall("place_order", {"item": text[6:]})], usage=Usage(50, 8))
        if text == "fail":
            raise ModelError("the model refused the request", code="model_invalid_request")
        return ModelReply(text=f"re: {text[:40]}")  # (usage estimated: deterministic)

    return Agent(
        instructions="You are the golden agent.",
        tools=[add, place_order],
        model=ScriptedModel(script, chunk=7),
        context_window=2_000,
        compaction=Compaction(keep_turns=1),
    )


class Masks:
    """Ids and times replaced by placeholders, each id by its order of first appearance."""

    IDS = re.compile(r"(ses|msg|turn|call|compact|clear|wh|it)_[0-9a-z]{26}(?![0-9a-z])|\b\d{13}-\d+\b")
    TIMES = re.compile(r'"(at|created_at)":\d+(\.\d+)?')

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        text = self.TIMES.sub(lambda m: f'"{m.group(1)}":<t>', text)
        return self.IDS.sub(self._one, text)

    def _one(self, m: re.Match[str]) -> str:
        kind = m.group(1) or "e"
        return self.seen.setdefault(m.group(0), f"<{kind}{sum(v.startswith(f'<{kind}') for v in self.seen.values())}>")


class SseReader:
    """The session's SSE stream read in the background: committed events (with their `id:`
    lines) and live events apart (a live event's place among committed ones depends on timing)."""

    def __init__(self, client: httpx.AsyncClient, sid: str) -> None:
        self.client, self.sid = client, sid
        self.committed: list[str] = []
        self.live: list[str] = []
        self.head: list[str] = []
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async with self.client.stream("GET", f"/v1/sessions/{self.sid}/events") as r:
            block: list[str] = []
            async for line in r.aiter_lines():
                if line:
                    block.append(line)
                    continue
                if block and not block[0].startswith(":"):  # (heartbeats come when they come)
                    text = "\n".join(block)
                    if block[0].startswith("id: "):
                        self.committed.append(text)
                    elif block[0].startswith("event: "):
                        self.live.append(text)
                    else:
                        self.head.append(text)
                    self.changed.set()
                block = []

    async def until(self, what: str, count: int = 1) -> None:
        async with asyncio.timeout(15):
            while sum(what in e for e in self.committed + self.live) < count:
                self.changed.clear()
                await self.changed.wait()


async def _wait(c: httpx.AsyncClient, sid: str, text: str, **body: Any) -> str:
    r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": text, **body})
    assert r.status_code == 200, r.text
    return r.text


async def _respond(c: httpx.AsyncClient, sid: str, waiting: str, decision: str, reason: str = "") -> None:
    rid = re.search(r'"request_id":"([^"]+)"', waiting)
    assert rid is not None, waiting
    r = await c.post(f"/v1/sessions/{sid}/responses", json={"request_id": rid.group(1), "decision": decision,
                                                             "reason": reason})  # fmt: skip
    assert r.status_code == 202, r.text


async def conversation(c: httpx.AsyncClient, receiver: Receiver) -> list[str]:
    """The whole scripted conversation; what keel sent, in sections."""
    r = await c.post("/v1/webhooks", json={"url": receiver.url("all"), "events": ["*"]})
    assert r.status_code == 201, r.text
    receiver.expect("all", r.json()["secret"])
    sid = (await c.post("/v1/sessions", json={"metadata": {"user": "ada", "plan": {"tier": 2}}})).json()["session_id"]
    sse = SseReader(c, sid)
    await sse.until('"type":"session.created"')  # the stream is open: the first turn's deltas reach it
    answers = [await _wait(c, sid, "hello", context={"page": "/invoices/17", "cart": "2 lamps"})]
    answers.append(await _wait(c, sid, "add 2 40", context="the user is on the sums page"))
    waiting = await _wait(c, sid, "order lamp")
    answers.append(waiting)
    await _respond(c, sid, waiting, "approve")
    await sse.until('"type":"turn.completed"', 3)
    waiting = await _wait(c, sid, "order desk", context=["turn only", "and more"])
    answers.append(waiting)
    await _respond(c, sid, waiting, "deny", "too expensive")
    await sse.until('"type":"turn.completed"', 4)
    answers.append(await _wait(c, sid, "fail"))
    answers.append(await _wait(c, sid, BIG, context={"page": None}))
    waiting = await _wait(c, sid, "order chair")
    answers.append(waiting)
    r = await c.post(f"/v1/sessions/{sid}/cancel", json={})
    assert r.status_code == 202, r.text
    await sse.until('"type":"turn.cancelled"')
    assert (await c.post(f"/v1/sessions/{sid}/compact")).status_code == 202
    await sse.until('"type":"session.waiting"')
    assert (await c.post(f"/v1/sessions/{sid}/clear")).status_code == 202
    await sse.until('"type":"session.waiting"', 2)
    answers.append(await _wait(c, sid, "bye", message_id="client-1"))
    answers.append(await _wait(c, sid, "bye again", message_id="client-1"))  # the same message: its turn
    await receiver.until(lambda rc: len({d.webhook_id for d in rc.delivered("all")}) >= len(sse.committed))
    assert (await c.delete(f"/v1/sessions/{sid}")).status_code == 204
    await sse.until("event: session.deleted")
    await asyncio.wait_for(sse.task, 5)  # the stream ends with it
    first: dict[str, Any] = {}
    for d in receiver.delivered("all"):
        first.setdefault(d.webhook_id, d)
    hooks = [f"{i}\n{d.body.decode()}" for i, d in first.items()]
    return [
        "== sse head", *sse.head,
        "== sse committed", *sse.committed,
        "== sse live", *sse.live,
        "== wait answers", *answers,
        "== webhook deliveries", *hooks,
    ]  # fmt: skip


async def test_wire_bytes_match_the_recording(serve: Any, receiver: Receiver) -> None:
    live = await serve(golden_agent(), api_keys=("k1",), webhook_allow_private=True)
    async with live.client("k1") as c:
        sections = await conversation(c, receiver)
    mask = Masks()
    got = "\n\n".join(mask(s) for s in sections) + "\n"
    if os.environ.get("KEEL_GOLDEN_RECORD"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(got)
    expected = GOLDEN.read_text()
    assert got.splitlines() == expected.splitlines()


# ---- the chat channels' outbound calls: Slack's Web API, Linear's agent activities ----------

SLACK_GOLDEN = Path(__file__).parent / "golden" / "slack_linear.txt"
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}\b")


async def test_slack_and_linear_calls_match_the_recording(serve: Any, slack: Any, linear: Any) -> None:
    live = await serve(
        golden_agent(),
        slack_signing_secret=SECRET,
        slack_bot_token=TOKEN,
        slack_api_url=slack.url,
        linear_webhook_secret=LINEAR_SECRET,
        linear_api_key=API_KEY,
        linear_api_url=linear.url,
        lease_ms=1000,
    )
    root = "1700000100.000100"
    async with live.client() as c:

        async def mention(text: str, n: int, ts: str) -> None:
            body = event_body(text, ts=ts, kind="message", thread_ts=root) if ts != root else event_body(
                f"<@{BOT}> {text}", ts=ts)  # fmt: skip
            assert (await post_event(c, body)).status_code == 200
            await slack.until(lambda s: len(s.posts(root)) >= n)

        await mention("hello", 1, root)
        await mention("add 2 40", 2, "1700000101.000100")
        await mention("order lamp", 3, "1700000102.000100")
        asked = [slack.posts(root)[-1]]  # (before its buttons are answered)
        assert (await click(c, click_body(slack.posts(root)[-1], "approve"))).status_code == 200
        await slack.until(lambda s: len(s.posts(root)) >= 4 and s.posts(root)[2].updates >= 1)
        await mention("order desk", 5, "1700000103.000100")
        asked.append(slack.posts(root)[-1])
        assert (await click(c, click_body(slack.posts(root)[-1], "deny"))).status_code == 200
        await slack.until(lambda s: len(s.posts(root)) >= 6 and s.posts(root)[4].updates >= 1)
        await mention("fail", 7, "1700000104.000100")

        async def hook(body: bytes) -> None:
            assert (await c.post("/v1/linear/webhook", content=body, headers=linear_signed(body))).status_code == 200

        await hook(created("as-g", comment="add 2 40"))
        await linear.until(lambda s: "response" in s.kinds("as-g"))
        await hook(prompted("as-g", "act-1", "order lamp"))
        await linear.until(lambda s: "elicitation" in s.kinds("as-g"))
        await hook(prompted("as-g", "act-2", "approve"))
        await linear.until(lambda s: s.kinds("as-g").count("response") == 2)
        await hook(prompted("as-g", "act-3", "fail"))
        await linear.until(lambda s: "error" in s.kinds("as-g"))
    lines = ["== slack"]
    for m in [*asked, *slack.posts(root)]:
        lines.append(f"{m.text!r} blocks={json.dumps(m.blocks)} metadata={json.dumps(m.metadata)} updates={m.updates}")
    lines.append("== linear")
    for a in linear.of("as-g"):
        lines.append(
            f"{json.dumps(a.content)} ephemeral={a.ephemeral} signal={a.signal} {json.dumps(a.signal_metadata)}"
        )
    mask = Masks()
    got = UUID.sub("<uuid>", mask("\n".join(lines))) + "\n"
    if os.environ.get("KEEL_GOLDEN_RECORD"):
        SLACK_GOLDEN.write_text(got)
    assert got.splitlines() == SLACK_GOLDEN.read_text().splitlines()

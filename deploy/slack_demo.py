"""`make slack-demo`: keel in Slack without a Slack workspace. Starts a local server that speaks
Slack's Web API (the one the tests use), `python -m app` with the Slack channel pointed at it
(`KEEL_SLACK_API_URL`; embedded Valkey, the demo agent), then plays a user: a mention, a reply in
the thread, an order that asks for approval, a click on Approve. Every request is signed the way
Slack signs them; the thread is printed as keel posts and updates it."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.channels.slack_server import (  # noqa: E402 (the local Slack server of the tests)
    BOT,
    SECRET,
    TOKEN,
    FakeSlack,
    Message,
    click_body,
    event_body,
    signed,
)
from tests.conftest import free_port  # noqa: E402
from tests.service import Service  # noqa: E402

THREAD = f"{time.time():.6f}"


def show(slack: FakeSlack, shown: dict[str, tuple[str, int]]) -> None:
    for m in slack.posts(THREAD):
        if shown.get(m.ts) != (m.text, m.updates):
            verb = "keel posts" if m.ts not in shown else "keel updates its post"
            buttons = " [Approve] [Deny]" if m.blocks and any(b["type"] == "actions" for b in m.blocks) else ""
            print(f"  {verb}: {m.text}{buttons}")
            shown[m.ts] = (m.text, m.updates)


async def say(c: httpx.AsyncClient, text: str, ts: str, *, first: bool = False) -> None:
    print(f"U0ALICE: {text}")
    mention = event_body(f"<@{BOT}> {text}", ts=ts)
    body = mention if first else event_body(text, ts=ts, kind="message", thread_ts=THREAD)
    r = await c.post("/v1/slack/events", content=body, headers={"Content-Type": "application/json", **signed(body)})
    assert r.status_code == 200, r.text


async def until(slack: FakeSlack, n: int, shown: dict[str, tuple[str, int]]) -> list[Message]:
    await slack.until(lambda s: len([m for m in s.posts(THREAD) if m.updates or not m.text.startswith("_")]) >= n)
    show(slack, shown)
    return slack.posts(THREAD)


async def play(base: str, slack: FakeSlack) -> None:
    shown: dict[str, tuple[str, int]] = {}
    async with httpx.AsyncClient(base_url=base, timeout=10) as c:
        await say(c, "add 2 and 3", THREAD, first=True)
        await until(slack, 1, shown)
        await say(c, "what time is it?", f"{time.time():.6f}")
        await until(slack, 2, shown)
        await say(c, "order a desk lamp", f"{time.time():.6f}")
        await slack.until(lambda s: any(m.blocks for m in s.posts(THREAD)))
        show(slack, shown)
        ask = next(m for m in slack.posts(THREAD) if m.blocks)
        print("U0ALICE clicks Approve")
        body = click_body(ask, "approve")
        headers = {"Content-Type": "application/x-www-form-urlencoded", **signed(body)}
        assert (await c.post("/v1/slack/interactivity", content=body, headers=headers)).status_code == 200
        await slack.until(lambda s: any("ordered" in m.text for m in s.posts(THREAD)))
        await slack.until(lambda s: any(m.updates and "Approved" in m.text for m in s.posts(THREAD)))
        show(slack, shown)


def main() -> int:
    slack = FakeSlack().start()
    with tempfile.TemporaryDirectory() as tmp:
        svc = Service(
            Path(tmp),
            free_port(),
            SLACK_SIGNING_SECRET=SECRET,
            SLACK_BOT_TOKEN=TOKEN,
            KEEL_SLACK_API_URL=slack.url,
        )
        try:
            svc.start()
            print(f"keel on {svc.base}, Slack's Web API at {slack.url}\n")
            asyncio.run(play(svc.base, slack))
            print("\nthe Web API calls keel made:", sorted({m for m, _ in slack.calls}))
        finally:
            svc.stop()
            slack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A React page on the AI SDK's `useChat` (`@ai-sdk/react`, with `DefaultChatTransport`,
`sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses` and `resume: true`)
against keel's `/v1/chat`, in headless Chromium: a reply streams in, an approval from the page
runs its tool once, a reload mid-turn resumes the reply once, and a reload while the turn waits
for approval shows the request again, to approve from the reloaded page.

The page (tests/js/page) is bundled with esbuild from the pinned tests/js install, once per test
session, and served beside keel on keel's own origin (keel answers no CORS): the test's ASGI
app sends `/usechat/*` to the bundle and everything else to keel. Its session id, keel's base
URL and the API key come in the page's URL."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from app import create_app
from app.settings import Settings
from tests.browser.test_widget import ARTIFACTS, CHROMIUM, FLAGS  # (skips this module without chromium)
from tests.conftest import LiveServer, ValkeyServer, free_port
from tests.frontend_agent import Gates, frontend_agent
from tests.jsclient import JS, skip_without_node

try:
    from playwright.async_api import Browser, Page, Request, async_playwright, expect
except ImportError:  # pragma: no cover
    pytest.skip("playwright is not installed (make install adds it)", allow_module_level=True)

pytestmark = [pytest.mark.browser, skip_without_node()]

KEY = "usechat-test-key"
PREFIX = "/usechat/"
SLOW_REPLY = "That took a while, but here it is: the slow reply."
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8"}


@pytest.fixture(scope="session")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """tests/js/page built with tests/js's esbuild into a temporary folder (index.html, page.js)."""
    out = tmp_path_factory.mktemp("usechat-page")
    subprocess.run(
        [
            str(JS / "node_modules" / ".bin" / "esbuild"),
            "page/app.jsx",
            "--bundle",
            "--minify",
            "--jsx=automatic",
            "--format=iife",
            '--define:process.env.NODE_ENV="production"',  # (React's production build)
            f"--outfile={out / 'page.js'}",
            "--log-level=warning",
        ],
        cwd=JS,
        check=True,
        timeout=120,
    )
    shutil.copy(JS / "page" / "index.html", out / "index.html")
    yield out


class WithPage:
    """keel's ASGI app with the page's files at `/usechat/` (from memory), on the same origin."""

    def __init__(self, keel: ASGIApp, folder: Path) -> None:
        self.keel = keel
        self.files = {p.name: (p.read_bytes(), TYPES[p.suffix]) for p in folder.iterdir() if p.suffix in TYPES}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            found = self.files.get(scope["path"][len(PREFIX) :] or "index.html")
            page = Response(found[0], media_type=found[1]) if found else Response("not found", 404)
            await page(scope, receive, send)
            return
        await self.keel(scope, receive, send)  # (the lifespan included)


@dataclass
class Keel:
    live: LiveServer
    client: httpx.AsyncClient
    runs: Any  # the agent's Counter of tool runs by call id
    gates: Gates

    async def session(self) -> str:
        sid: str = (await self.client.post("/v1/sessions")).json()["session_id"]
        return sid

    def page_url(self, sid: str) -> str:
        return f"{self.live.base}{PREFIX}?session={sid}&api={self.live.base}&key={KEY}"


@pytest.fixture
async def keel(valkey: ValkeyServer, redis: Any, bundle: Path) -> AsyncIterator[Keel]:
    agent, runs, gates = frontend_agent()
    settings = Settings(sse_heartbeat=0.5, api_keys=(KEY,))  # (the page sends its key in `headers`)
    app = create_app(settings, redis_url=valkey.url, agent=agent)
    live = LiveServer(WithPage(app, bundle), free_port(), settings)
    await live.start()
    client = live.client(KEY)
    try:
        yield Keel(live, client, runs, gates)
    finally:
        await client.aclose()
        await live.stop()


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        await b.close()


@pytest.fixture
async def page(browser: Browser, keel: Keel) -> AsyncIterator[Page]:
    """A page of its own (closed before keel stops: no stream of it is left open then)."""
    context = await browser.new_context()
    p = await context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    p.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    yield p
    await context.close()
    assert errors == []  # no script error on the page


async def open_chat(page: Page, keel: Keel, sid: str) -> None:
    await page.goto(keel.page_url(sid))
    await expect(page.locator("#chat")).to_have_attribute("data-status", "ready", timeout=10_000)


async def say(page: Page, text: str) -> None:
    await page.locator("#prompt").fill(text)
    await page.locator("#prompt").press("Enter")


async def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def chat_posts(page: Page) -> list[str]:
    """What the page posts to /v1/chat, as it posts: "message" (a user's) or "continuation"."""
    posts: list[str] = []

    def seen(request: Request) -> None:
        if request.method == "POST" and request.url.endswith("/v1/chat"):
            last = (request.post_data_json or {}).get("messages", [{}])[-1]
            posts.append("message" if last.get("role") == "user" else "continuation")

    page.on("request", seen)
    return posts


WATCH_ASSISTANT = """() => {
  window.seenTexts = [];
  const list = document.querySelector("#messages");
  new MutationObserver(() => {
    const last = [...list.querySelectorAll(".message.assistant")].at(-1);
    const text = last ? [...last.querySelectorAll(".text")].map((e) => e.textContent).join("") : null;
    if (text !== null && window.seenTexts.at(-1) !== text) window.seenTexts.push(text);
  }).observe(list, { childList: true, subtree: true, characterData: true });
}"""


async def test_a_reply_streams_in(page: Page, keel: Keel) -> None:
    sid = await keel.session()
    await open_chat(page, keel, sid)
    await page.evaluate(WATCH_ASSISTANT)
    text = "hello from a React page: this reply comes in piece by piece, four characters a delta"
    reply = f"Echo: {text}"
    await say(page, text)
    await expect(page.locator(".message.user .text")).to_have_text([text])
    await expect(page.locator(".message.assistant .text")).to_have_text([reply])
    await expect(page.locator("#chat")).to_have_attribute("data-status", "ready")
    seen: list[str] = await page.evaluate("window.seenTexts")
    partial = [s for s in seen if s and s != reply]
    assert partial, seen  # the text grew over several renders, not all at once
    assert all(reply.startswith(s) for s in seen), seen
    history = (await keel.client.get(f"/v1/sessions/{sid}/history")).json()["items"]
    assert [(i["role"], i["text"]) for i in history][-1] == ("assistant", reply)


async def test_approve_from_the_page_runs_the_tool_once(page: Page, keel: Keel) -> None:
    sid = await keel.session()
    posts = chat_posts(page)
    await open_chat(page, keel, sid)
    await say(page, "pay 5")
    tool = page.locator(".message.assistant .tool")
    await expect(tool).to_have_attribute("data-state", "approval-requested")
    await expect(tool).to_contain_text('pay {"amount":5}')
    await expect(page.locator(".message.assistant .text")).to_have_text(["I will pay."])
    assert not keel.runs  # nothing ran before the approval
    await tool.get_by_role("button", name="Approve").click()
    await expect(page.locator(".message.assistant .text")).to_have_text(["I will pay.", "Done: paid 5"])
    await expect(tool).to_have_attribute("data-state", "output-available")
    await expect(tool).to_contain_text('→ "paid 5"')
    await expect(tool.get_by_role("button", name="Approve")).to_have_count(0)
    await expect(page.locator(".message.assistant")).to_have_count(1)  # one assistant message, continued
    await expect(page.locator("#chat")).to_have_attribute("data-status", "ready")
    assert list(keel.runs.values()) == [1]
    assert posts == ["message", "continuation"]  # sendAutomaticallyWhen sent the answer once, then held
    await shot(page, "usechat")
    assert (await keel.client.get(f"/v1/sessions/{sid}")).json()["status"] == "idle"


async def test_a_reload_mid_turn_resumes_the_reply_once(page: Page, keel: Keel) -> None:
    sid = await keel.session()
    await open_chat(page, keel, sid)
    await say(page, "slow")
    await expect(page.locator(".message.user .text")).to_have_text(["slow"])
    await asyncio.wait_for(keel.gates.slow_began.wait(), 10)

    # useChat with `resume: true` asks GET /v1/chat/{id}/stream as the reloaded page mounts
    stream_url = f"{keel.live.base}/v1/chat/{sid}/stream"
    async with page.expect_response(stream_url, timeout=10_000) as resumed:
        await page.reload()
    assert (await resumed.value).status == 200
    # its `start` came (the message is the turn's; the status stays "submitted" until a part comes)
    await expect(page.locator(".message.assistant")).to_have_attribute("data-id", re.compile(r"^turn_"))
    keel.gates.slow.set()

    await expect(page.locator(".message.assistant .text")).to_have_text([SLOW_REPLY])
    await expect(page.locator("#chat")).to_have_attribute("data-status", "ready")
    await expect(page.locator(".message")).to_have_count(1)  # the reply once (the reloaded page kept no history)
    await expect(page.get_by_text(SLOW_REPLY)).to_have_count(1)
    await shot(page, "usechat-resumed")
    history = (await keel.client.get(f"/v1/sessions/{sid}/history")).json()["items"]
    assert [(i["role"], i["text"]) for i in history] == [("user", "slow"), ("assistant", SLOW_REPLY)]
    assert (await keel.client.get(f"/v1/chat/{sid}/stream")).status_code == 204


async def test_a_reload_while_the_turn_waits_for_approval_then_approve(page: Page, keel: Keel) -> None:
    sid = await keel.session()
    posts = chat_posts(page)
    await open_chat(page, keel, sid)
    await say(page, "pay 7")
    tool = page.locator(".message.assistant .tool")
    await expect(tool).to_have_attribute("data-state", "approval-requested")
    await expect(page.locator("#chat")).to_have_attribute("data-status", "ready")
    await page.reload()  # the resumed stream replays the turn up to its approval request
    await expect(tool).to_have_attribute("data-state", "approval-requested")
    await expect(page.locator(".message.assistant .text")).to_have_text(["I will pay."])
    await expect(page.locator("#chat")).to_have_attribute("data-status", "ready")
    await tool.get_by_role("button", name="Approve").click()
    await expect(page.locator(".message.assistant .text")).to_have_text(["I will pay.", "Done: paid 7"])
    await expect(tool).to_have_attribute("data-state", "output-available")
    await expect(page.locator("#chat")).to_have_attribute("data-status", "ready")
    await expect(page.locator(".message")).to_have_count(1)  # (the reloaded page: the resumed message only)
    assert list(keel.runs.values()) == [1]
    assert posts == ["message", "continuation"]

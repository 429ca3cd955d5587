"""A React page on the AI SDK's `useChat` (`@ai-sdk/react`, with `DefaultChatTransport`,
`sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses` and `resume: true`)
against keel's `/v1/chat`, in headless Chromium: a reply streams in, an approval from the page
runs its tool once, a reload mid-turn resumes the reply once, and a reload while the turn waits
for approval shows the request again, to approve from the reloaded page.

The page (tests/js/page) is bundled with esbuild from the pinned tests/js install, once per test
session, and served beside keel on keel's own origin: the test's ASGI app sends `/usechat/*` to
the bundle and everything else to keel. Its session id, keel's base URL and the API key come in
the page's URL.

As a deployment has it, the page is also served from an origin of its own (another port) to a
keel whose `allowed_origins` names it: the test mints a session token with the key and gives the
page only that, which the transport sends as `Bearer` across origins (with the browser's
preflights); a keel that does not allow the page's origin gets no message from it at all."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from starlette.applications import Starlette
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


# ---- the page on an origin of its own ------------------------------------------------------------


class Seen:
    """keel's ASGI app, noting each request a browser makes (one with an `Origin`) as it comes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests: list[tuple[str, str, str, str]] = []  # (method, path, origin, authorization)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            if b"origin" in headers:
                auth = headers.get(b"authorization", b"").decode()
                self.requests.append((scope["method"], scope["path"], headers[b"origin"].decode(), auth))
        await self.app(scope, receive, send)


@dataclass
class CrossKeel(Keel):
    page_origin: str  # where the page is served from (not keel's origin)
    seen: Seen

    async def token(self, sid: str) -> str:
        """A session token, minted with the key as a deployment's backend does."""
        minted = await self.client.post(f"/v1/sessions/{sid}/tokens")
        assert minted.status_code == 201, minted.text
        token: str = minted.json()["token"]
        return token

    def page_url_with(self, sid: str, token: str) -> str:
        url = f"{self.page_origin}{PREFIX}?" + urlencode({"session": sid, "api": self.live.base, "token": token})
        assert KEY not in url  # the page gets the token only
        return url


@pytest.fixture
async def page_server(bundle: Path) -> AsyncIterator[LiveServer]:
    """The page alone, on a port (so an origin) of its own."""
    live = LiveServer(WithPage(Starlette(), bundle), free_port())
    await live.start()
    yield live
    await live.stop()


@pytest.fixture
async def keels(
    valkey: ValkeyServer, redis: Any, page_server: LiveServer
) -> AsyncIterator[Callable[..., Awaitable[CrossKeel]]]:
    """`await keels(allowed_origins)` -> a keel on another port than the page's, with that setting."""
    started: list[CrossKeel] = []

    async def start(allowed_origins: tuple[str, ...]) -> CrossKeel:
        agent, runs, gates = frontend_agent()
        settings = Settings(sse_heartbeat=0.5, api_keys=(KEY,), allowed_origins=allowed_origins)
        seen = Seen(create_app(settings, redis_url=valkey.url, agent=agent))
        live = LiveServer(seen, free_port(), settings)
        await live.start()
        keel = CrossKeel(live, live.client(KEY), runs, gates, page_server.base, seen)
        started.append(keel)
        assert keel.page_origin != live.base
        return keel

    yield start
    for keel in started:
        await keel.client.aclose()
        await keel.live.stop()


@dataclass
class Tab:
    page: Page
    errors: list[str]  # the page's script errors and console errors
    expected: re.Pattern[str] | None = None  # console errors a test expects (the browser's refusals)


@pytest.fixture
async def tab(browser: Browser, keels: Any) -> AsyncIterator[Tab]:
    """A page of its own (closed before the keels stop), failing the test on a console error it
    does not expect."""
    context = await browser.new_context()
    p = await context.new_page()
    t = Tab(p, [])
    p.on("pageerror", lambda exc: t.errors.append(str(exc)))
    p.on("console", lambda msg: t.errors.append(msg.text) if msg.type == "error" else None)
    yield t
    await context.close()
    assert [e for e in t.errors if not (t.expected and t.expected.search(e))] == []


async def test_a_page_of_another_origin_chats_and_resumes_with_a_session_token(
    tab: Tab, keels: Callable[..., Awaitable[CrossKeel]], page_server: LiveServer
) -> None:
    keel = await keels(allowed_origins=(page_server.base,))
    page = tab.page
    sid = await keel.session()
    token = await keel.token(sid)
    await page.goto(keel.page_url_with(sid, token))
    await expect(page.locator("#chat")).to_have_attribute("data-status", "ready", timeout=10_000)

    # a reply streams in, across origins
    await page.evaluate(WATCH_ASSISTANT)
    text = "hello from a page of another origin, with a token for this session only"
    reply = f"Echo: {text}"
    await say(page, text)
    await expect(page.locator(".message.user .text")).to_have_text([text])
    await expect(page.locator(".message.assistant .text")).to_have_text([reply])
    await expect(page.locator("#chat")).to_have_attribute("data-status", "ready")
    seen: list[str] = await page.evaluate("window.seenTexts")
    assert [s for s in seen if s and s != reply], seen  # in pieces, not all at once
    assert all(reply.startswith(s) for s in seen), seen

    # a reload mid-turn resumes it: GET /v1/chat/{id}/stream, with the token, across origins
    await say(page, "slow")
    await expect(page.locator(".message.user .text")).to_have_text([text, "slow"])
    await asyncio.wait_for(keel.gates.slow_began.wait(), 10)
    stream_url = f"{keel.live.base}/v1/chat/{sid}/stream"
    async with page.expect_response(lambda r: r.url == stream_url and r.request.method == "GET") as resumed:
        await page.reload()
    response = await resumed.value
    assert response.status == 200
    assert await response.header_value("access-control-allow-origin") == page_server.base
    assert await response.request.header_value("authorization") == f"Bearer {token}"
    await expect(page.locator(".message.assistant")).to_have_attribute("data-id", re.compile(r"^turn_"))
    keel.gates.slow.set()
    await expect(page.locator(".message.assistant .text")).to_have_text([SLOW_REPLY])
    await expect(page.locator("#chat")).to_have_attribute("data-status", "ready")
    await expect(page.locator(".message")).to_have_count(1)  # (the reloaded page: the resumed message only)
    await expect(page.get_by_text(SLOW_REPLY)).to_have_count(1)
    await shot(page, "usechat-cross-origin")

    history = (await keel.client.get(f"/v1/sessions/{sid}/history")).json()["items"]
    assert [(i["role"], i["text"]) for i in history] == [
        ("user", text),
        ("assistant", reply),
        ("user", "slow"),
        ("assistant", SLOW_REPLY),
    ]
    # what keel had from the browser: real preflights (no credential), then the token, never the key
    requests = keel.seen.requests
    assert {origin for _, _, origin, _ in requests} == {page_server.base}
    assert {auth for method, _, _, auth in requests if method != "OPTIONS"} == {f"Bearer {token}"}
    assert {auth for method, _, _, auth in requests if method == "OPTIONS"} == {""}
    calls = [(method, path) for method, path, _, _ in requests]
    for method, path in (("POST", "/v1/chat"), ("GET", f"/v1/chat/{sid}/stream")):
        assert ("OPTIONS", path) in calls and calls.index(("OPTIONS", path)) < calls.index((method, path)), calls
    assert calls.count(("POST", "/v1/chat")) == 2
    assert (await keel.client.get(f"/v1/chat/{sid}/stream")).status_code == 204


@pytest.mark.parametrize("allowed", [("http://app.example",), ()], ids=["another-origin-allowed", "none-allowed"])
async def test_a_page_of_an_origin_not_allowed_sends_nothing(
    tab: Tab, keels: Callable[..., Awaitable[CrossKeel]], allowed: tuple[str, ...]
) -> None:
    keel = await keels(allowed_origins=allowed)
    page = tab.page
    tab.expected = re.compile(r"has been blocked by CORS policy|net::ERR_FAILED")
    sid = await keel.session()
    token = await keel.token(sid)
    chat_url = f"{keel.live.base}/v1/chat"
    stream_url = f"{chat_url}/{sid}/stream"

    # useChat's `resume` asks for the stream as the page mounts: the browser refuses that already
    async with page.expect_event("requestfailed", lambda r: r.url == stream_url, timeout=10_000) as resume:
        await page.goto(keel.page_url_with(sid, token))
    assert (await resume.value).failure == "net::ERR_FAILED"
    await expect(page.locator("#chat")).to_have_attribute("data-status", "error")

    text = "hello from an origin keel does not allow"
    async with page.expect_event(
        "requestfailed", lambda r: r.url == chat_url and r.method == "POST", timeout=10_000
    ) as failed:
        await say(page, text)
    assert (await failed.value).failure == "net::ERR_FAILED"
    await expect(page.locator(".message.user .text")).to_have_text([text])  # (useChat shows it as it sends)
    await expect(page.locator("#chat")).to_have_attribute("data-status", "error")
    await expect(page.locator("#error")).to_have_text("Failed to fetch")
    await expect(page.locator(".message.assistant")).to_have_count(0)
    blocked = [e for e in tab.errors if "blocked by CORS policy" in e]
    assert any(f"'{chat_url}'" in e for e in blocked) and any(stream_url in e for e in blocked), tab.errors

    # keel answered the preflight only: the message never came, nothing is recorded
    calls = [(method, path) for method, path, _, _ in keel.seen.requests]
    assert ("OPTIONS", "/v1/chat") in calls and ("POST", "/v1/chat") not in calls, calls
    assert (await keel.client.get(f"/v1/sessions/{sid}/history")).json()["items"] == []
    assert (await keel.client.get(f"/v1/sessions/{sid}")).json()["status"] == "idle"
    # (and not for the token: it opens this session's chat for a caller that is no browser)
    async with keel.live.client(token) as backend:
        assert (await backend.get(f"/v1/chat/{sid}/stream")).status_code == 204

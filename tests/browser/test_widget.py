"""The widget on the demo page, in headless Chromium (Debian's package, driven by Playwright):
chat, page context, approval from the panel, reload and server restart mid-turn without
duplicates. Screenshots go to tests/artifacts/."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app import load_agent
from harness import Agent, tool
from harness.models import ModelEvent, ModelReply, ModelRequest, ScriptedModel, TextDelta, ToolCall

pytestmark = pytest.mark.browser
CHROMIUM = os.environ.get("KEEL_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
# As root on a closed network: no sandbox, and none of Chromium's background connections.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

try:
    from playwright.async_api import Browser, BrowserContext, Page, async_playwright, expect
except ImportError:  # pragma: no cover
    pytest.skip("playwright is not installed (make install adds it)", allow_module_level=True)
if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"no Chromium at {CHROMIUM}: `make test` installs Debian's chromium when run as root with apt",
        allow_module_level=True,
    )


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        await b.close()


@pytest.fixture
async def page(browser: Browser, serve: Any) -> AsyncIterator[Page]:
    live = await serve(load_agent("app.demo:agent"), demo_page=True)
    context = await browser.new_context(base_url=live.base)
    p = await context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    p.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    await p.goto("/")
    await expect(p.locator("#assistant")).to_have_attribute("data-keel-status", "connected", timeout=10_000)
    p.live = live  # type: ignore[attr-defined]
    yield p
    await context.close()
    assert errors == []  # no script error on the page


async def say(page: Page, text: str) -> None:
    await page.locator(".keel-input").fill(text)
    await page.locator(".keel-input").press("Enter")


async def no_duplicates(page: Page) -> list[str]:
    ids: list[str] = await page.locator("[data-event-id]").evaluate_all("(els) => els.map((e) => e.dataset.eventId)")
    assert len(ids) == len(set(ids)), ids
    return ids


async def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


async def test_chat_with_the_demo_agent(page: Page) -> None:
    await say(page, "hello")
    await expect(page.locator(".keel-user")).to_have_text(["hello"])
    reply = page.locator(".keel-assistant").last
    await expect(reply).to_contain_text("You said: 'hello'")
    await expect(reply).to_contain_text("3 page context entries")  # route, selection, cart
    await say(page, "add 2 and 40")
    await expect(page.locator(".keel-tool")).to_have_text(["⚙ add → 42"])
    await expect(page.locator(".keel-assistant").last).to_have_text("The add tool says: 42")
    await no_duplicates(page)
    await shot(page, "widget-chat")


async def test_the_agent_answers_from_the_page_as_it_is_now(page: Page) -> None:
    await page.get_by_role("button", name="Blue lamp").click()
    await say(page, "what am I looking at?")
    await expect(page.locator(".keel-assistant").last).to_have_text("You are looking at the Blue lamp (/products/1).")
    await page.get_by_role("button", name="Brass floor lamp").click()
    await say(page, "and now, what am I looking at?")
    await expect(page.locator(".keel-assistant")).to_have_count(2)
    newest = page.locator(".keel-assistant").last
    await expect(newest).to_have_text("You are looking at the Brass floor lamp (/products/3).")
    await expect(newest).not_to_contain_text("Blue")
    await shot(page, "widget-page-context")


async def test_approve_a_tool_from_the_panel(page: Page) -> None:
    await page.get_by_role("button", name="Green lamp").click()
    await say(page, "order it")
    card = page.locator(".keel-approval")
    await expect(card.locator(".keel-question")).to_have_text("Order the Green lamp?")  # the page's words
    await expect(card.locator(".keel-call")).to_have_text("⚙ place_order")  # the call, below
    await expect(card.locator("dt")).to_have_text(["item"])
    await expect(card.locator("dd")).to_have_text(["Green lamp"])
    await shot(page, "widget-approval")
    await card.get_by_role("button", name="Approve").click()
    await expect(card).to_have_attribute("data-decision", "approve")
    await expect(page.locator(".keel-tool")).to_have_text(["⚙ place_order → ordered the Green lamp (pretend)"])
    await expect(page.locator(".keel-assistant").last).to_have_text(
        "The place_order tool says: ordered the Green lamp (pretend)"
    )
    await no_duplicates(page)


async def test_reload_and_restart_mid_turn_resume_without_duplicates(page: Page, serve: Any) -> None:
    await say(page, "hello")
    await expect(page.locator(".keel-assistant[data-event-id]")).to_have_count(1)  # streamed, then committed
    await page.get_by_role("button", name="Blue lamp").click()
    await say(page, "order it")
    await expect(page.locator(".keel-approval")).to_have_count(1)  # the turn waits for a person
    before = await no_duplicates(page)

    await page.reload()  # mid-turn: the page comes back with the same conversation, once
    await expect(page.locator("#assistant")).to_have_attribute("data-keel-status", "connected", timeout=10_000)
    await expect(page.locator(".keel-approval")).to_have_count(1)
    assert await no_duplicates(page) == before
    await expect(page.locator(".keel-user")).to_have_text(["hello", "order it"])

    live = page.live  # type: ignore[attr-defined]
    await live.stop()  # the server restarts (1012): the widget reconnects after its last event
    await expect(page.locator("#assistant")).not_to_have_attribute("data-keel-status", "connected")
    await serve(load_agent("app.demo:agent"), demo_page=True, port=live.port)
    await expect(page.locator("#assistant")).to_have_attribute("data-keel-status", "connected", timeout=15_000)
    await page.locator(".keel-approval").get_by_role("button", name="Approve").click()
    await expect(page.locator(".keel-assistant").last).to_have_text(
        "The place_order tool says: ordered the Blue lamp (pretend)"
    )
    ids = await no_duplicates(page)
    assert ids[: len(before)] == before
    await expect(page.locator(".keel-user")).to_have_text(["hello", "order it"])
    await expect(page.locator(".keel-approval")).to_have_count(1)
    await shot(page, "widget-after-restart")


class Typing:
    """A model that streams "Hello " and then waits for `more` before the rest of its reply."""

    def __init__(self) -> None:
        self.more = asyncio.Event()

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        if request.messages[-1].role != "user":
            yield ModelReply(text="done")
            return
        yield TextDelta("Hel")
        yield TextDelta("lo ")
        await self.more.wait()
        yield TextDelta("world")
        yield ModelReply(text="Hello world")


async def typing_page(browser: Browser, serve: Any, model: Typing) -> tuple[Any, BrowserContext, Page]:
    """The demo page, connected, on an agent whose model is `model`."""
    live = await serve(Agent(instructions="t", model=model), demo_page=True)
    context = await browser.new_context(base_url=live.base)
    page = await context.new_page()
    await page.goto("/")
    await expect(page.locator("#assistant")).to_have_attribute("data-keel-status", "connected", timeout=10_000)
    return live, context, page


async def test_a_streamed_reply_shows_as_it_comes_then_as_committed(browser: Browser, serve: Any) -> None:
    model = Typing()
    _, context, page = await typing_page(browser, serve, model)
    await say(page, "greet me")
    reply = page.locator(".keel-assistant")
    await expect(reply).to_have_text(["Hello"])  # the first two deltas, shown before the reply is done
    await shot(page, "widget-streaming")
    model.more.set()
    await expect(reply).to_have_text(["Hello world"])  # one node: the deltas, then message.completed
    await no_duplicates(page)
    await context.close()


async def test_the_partial_text_of_a_cancelled_reply_goes_away(browser: Browser, serve: Any) -> None:
    model = Typing()
    live, context, page = await typing_page(browser, serve, model)
    await say(page, "greet me")
    reply = page.locator(".keel-assistant")
    await expect(reply).to_have_text(["Hello"])
    sid = await page.evaluate("window.keelDemo.session")
    async with live.client() as c:
        assert (await c.post(f"/v1/sessions/{sid}/cancel")).status_code == 202
    await expect(reply).to_have_count(0)  # the turn ended without it: nothing of it stays shown
    await context.close()


async def test_an_approval_card_without_the_pages_words_says_it_from_the_tool(browser: Browser, serve: Any) -> None:
    @tool(approval=True)
    def delete_file(path: str) -> str:
        """Delete a file."""
        return "deleted"

    @tool(approval=True)
    def sendEmail(to: str, subject: str) -> str:  # (a camelCase name reads as words too)
        """Send an email."""
        return "sent"

    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "tool":
            return ModelReply(text="done")
        calls = [
            ToolCall("delete_file", {"path": "/tmp/notes.txt"}),
            ToolCall("sendEmail", {"to": "ada@x", "subject": "hi"}),
        ]
        return ModelReply(tool_calls=calls)

    live = await serve(
        Agent(instructions="t", tools=[delete_file, sendEmail], model=ScriptedModel(script)), demo_page=True
    )
    context = await browser.new_context(base_url=live.base)
    page = await context.new_page()
    await page.goto("/")
    await expect(page.locator("#assistant")).to_have_attribute("data-keel-status", "connected", timeout=10_000)
    await say(page, "tidy up")
    cards = page.locator(".keel-approval")
    await expect(cards.locator(".keel-question")).to_have_text(["Delete file: /tmp/notes.txt?", "Send email?"])
    await expect(cards.last.locator("dt")).to_have_text(["to", "subject"])  # each argument, below
    await expect(cards.last.locator("dd")).to_have_text(["ada@x", "hi"])
    await context.close()

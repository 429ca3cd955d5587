"""The demo panel's conversations menu (the widget's `conversations` option), in headless
Chromium: two conversations listed by their titles, most recent first; switching shows one's
messages and sends to it; "New conversation" starts an empty one (and, on an empty one, stays);
a reload keeps the conversation shown; the keyboard works the menu; it fits a phone.
Screenshots go to tests/artifacts/conversations-*.png."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from app import load_agent
from tests.browser.test_demo_mobile import fits
from tests.browser.test_widget import CHROMIUM, FLAGS, no_duplicates, say, shot  # (skips without chromium)

try:
    from playwright.async_api import Browser, Locator, Page, async_playwright, expect
except ImportError:  # pragma: no cover
    pytest.skip("playwright is not installed (make install adds it)", allow_module_level=True)

pytestmark = pytest.mark.browser


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        await b.close()


async def demo(browser: Browser, serve: Any, **context: Any) -> AsyncIterator[Page]:
    live = await serve(load_agent("app.demo:agent"), demo_page=True)
    ctx = await browser.new_context(base_url=live.base, **context)
    page = await ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    await page.goto("/")
    await connected(page)
    yield page
    await ctx.close()
    assert errors == []  # no script error on the page


@pytest.fixture
async def page(browser: Browser, serve: Any) -> AsyncIterator[Page]:
    async for p in demo(browser, serve):
        yield p


async def connected(page: Page) -> None:
    await expect(page.locator("#assistant")).to_have_attribute("data-keel-status", "connected", timeout=10_000)


def menu(page: Page) -> Locator:
    return page.get_by_role("menu", name="Conversations")


def listed(page: Page) -> Locator:
    """The conversations in the menu (not "New conversation")."""
    return menu(page).get_by_role("menuitemradio")


async def open_menu(page: Page) -> None:
    await page.get_by_role("button", name="Conversations").click()
    await expect(menu(page)).to_be_visible()
    await expect(menu(page)).not_to_have_attribute("aria-busy", "true")  # the list is in


async def chat(page: Page, text: str, replies: int) -> None:
    """Say `text`, and wait for the reply: the conversation then has `replies` of them."""
    await say(page, text)
    await expect(page.locator(".keel-assistant[data-event-id]")).to_have_count(replies)
    await expect(page.locator(".keel-assistant").last).to_contain_text(f"You said: {text!r}.")


async def new_conversation(page: Page) -> None:
    await open_menu(page)
    await menu(page).get_by_role("menuitem", name="New conversation").click()
    await expect(menu(page)).to_be_hidden()
    await connected(page)


async def test_two_conversations_are_listed_by_title_and_switched(page: Page) -> None:
    first = await page.evaluate("window.keelDemo.session")
    await chat(page, "tell me about lamps", 1)
    await new_conversation(page)
    await expect(page.locator(".keel-log > *")).to_have_count(0)
    assert await page.evaluate("window.keelDemo.session") != first
    await chat(page, "and about bulbs", 1)

    await open_menu(page)  # both, by their first message, the latest activity first
    await expect(listed(page)).to_have_text(["and about bulbs", "tell me about lamps"])
    await expect(listed(page).first).to_have_attribute("aria-checked", "true")  # the one shown
    await expect(listed(page).last).to_have_attribute("aria-checked", "false")
    await shot(page, "conversations-menu")

    await listed(page).get_by_text("tell me about lamps").click()  # switch to the first
    await expect(menu(page)).to_be_hidden()
    await connected(page)
    await expect(page.locator(".keel-user")).to_have_text(["tell me about lamps"])  # its history, only
    await expect(page.locator(".keel-assistant")).to_contain_text(["You said: 'tell me about lamps'."])
    assert await page.evaluate("window.keelDemo.session") == first
    await chat(page, "and the brass one?", 2)  # messages go to it now
    await expect(page.locator(".keel-user")).to_have_text(["tell me about lamps", "and the brass one?"])
    await no_duplicates(page)
    await shot(page, "conversations-switched")

    await open_menu(page)  # it moved to the top
    await expect(listed(page)).to_have_text(["tell me about lamps", "and about bulbs"])
    await expect(listed(page).first).to_have_attribute("aria-checked", "true")
    await page.keyboard.press("Escape")
    await expect(menu(page)).to_be_hidden()


async def test_a_new_conversation_is_empty_and_a_reload_keeps_the_one_shown(page: Page) -> None:
    await chat(page, "tell me about lamps", 1)
    await new_conversation(page)
    await expect(page.locator(".keel-log > *")).to_have_count(0)
    fresh = await page.evaluate("window.keelDemo.session")
    await open_menu(page)
    await expect(listed(page)).to_have_text(["Untitled conversation", "tell me about lamps"])
    await expect(listed(page).first).to_have_attribute("aria-checked", "true")
    await menu(page).get_by_role("menuitem", name="New conversation").click()  # on an empty one: stays
    await expect(menu(page)).to_be_hidden()
    assert await page.evaluate("window.keelDemo.session") == fresh
    await open_menu(page)
    await expect(listed(page)).to_have_count(2)  # no second empty one
    await page.keyboard.press("Escape")

    await page.reload()  # the conversation shown is kept: the empty one
    await connected(page)
    assert await page.evaluate("window.keelDemo.session") == fresh
    await expect(page.locator(".keel-log > *")).to_have_count(0)
    await open_menu(page)
    await expect(listed(page).first).to_have_attribute("aria-checked", "true")
    await listed(page).get_by_text("tell me about lamps").click()
    await connected(page)
    await expect(page.locator(".keel-user")).to_have_text(["tell me about lamps"])

    await page.reload()  # and the one switched to
    await connected(page)
    await expect(page.locator(".keel-user")).to_have_text(["tell me about lamps"])
    await expect(page.locator(".keel-assistant")).to_contain_text(["You said: 'tell me about lamps'."])
    await no_duplicates(page)
    await shot(page, "conversations-after-reload")


async def test_the_keyboard_works_the_menu(page: Page) -> None:
    await chat(page, "first", 1)
    await new_conversation(page)
    await chat(page, "second", 1)

    button = page.get_by_role("button", name="Conversations")
    await expect(button).to_have_attribute("aria-expanded", "false")
    await button.focus()
    await page.keyboard.press("Enter")
    await expect(menu(page)).to_be_visible()
    await expect(button).to_have_attribute("aria-expanded", "true")
    new = menu(page).get_by_role("menuitem", name="New conversation")
    await expect(new).to_be_focused()  # the menu takes the focus
    await expect(listed(page)).to_have_text(["second", "first"])
    await page.keyboard.press("ArrowUp")  # it wraps round
    await expect(listed(page).last).to_be_focused()
    await page.keyboard.press("Home")
    await expect(new).to_be_focused()
    await page.keyboard.press("Escape")  # closed, the focus back on the button
    await expect(menu(page)).to_be_hidden()
    await expect(button).to_be_focused()
    await expect(button).to_have_attribute("aria-expanded", "false")

    await page.keyboard.press("Enter")
    await expect(listed(page)).to_have_count(2)
    await page.keyboard.press("End")
    await expect(listed(page).last).to_be_focused()
    await page.keyboard.press("Enter")  # "first"
    await expect(menu(page)).to_be_hidden()
    await connected(page)
    await expect(page.locator(".keel-user")).to_have_text(["first"])
    await expect(page.locator(".keel-input")).to_be_focused()  # ready to type there
    await page.keyboard.type("more")
    await page.keyboard.press("Enter")
    await expect(page.locator(".keel-user")).to_have_text(["first", "more"])


@pytest.mark.parametrize("width", [420, 360])
async def test_the_menu_fits_a_phone(browser: Browser, serve: Any, width: int) -> None:
    phone = {"viewport": {"width": width, "height": 800}, "is_mobile": True, "has_touch": True}
    async for page in demo(browser, serve, **phone):
        await chat(page, " ".join(["a title long enough to be cut short at the end of the menu's line"] * 2), 1)
        await open_menu(page)
        await expect(listed(page)).to_have_count(1)
        await fits(page)
        box = await menu(page).bounding_box()
        panel = await page.locator(".keel-panel").bounding_box()
        assert box is not None and panel is not None
        assert panel["x"] <= box["x"] and box["x"] + box["width"] <= panel["x"] + panel["width"], (box, panel)
        await shot(page, f"conversations-mobile-{width}")

"""The demo page on a phone (420 px wide, 360 px too), in headless Chromium: it fits with no
sideways scroll, the panel included; a reply streams in; the approval card asks in words; an
approved order moves the cart; a reload keeps the selected lamp. Screenshots go to
tests/artifacts/demo-mobile*.png."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from app import load_agent
from tests.browser.test_widget import CHROMIUM, FLAGS, no_duplicates, say, shot  # (skips without chromium)

try:
    from playwright.async_api import Browser, Page, async_playwright, expect
except ImportError:  # pragma: no cover
    pytest.skip("playwright is not installed (make install adds it)", allow_module_level=True)

pytestmark = pytest.mark.browser
PHONE = {"width": 420, "height": 800}


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        await b.close()


async def open_demo(browser: Browser, serve: Any, width: int = PHONE["width"]) -> AsyncIterator[Page]:
    live = await serve(load_agent("app.demo:agent"), demo_page=True)
    context = await browser.new_context(
        base_url=live.base, viewport={"width": width, "height": PHONE["height"]}, is_mobile=True, has_touch=True
    )
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    await connected(page, "/")
    yield page
    await context.close()
    assert errors == []  # no script error on the page


@pytest.fixture
async def phone(browser: Browser, serve: Any) -> AsyncIterator[Page]:
    async for page in open_demo(browser, serve):
        yield page


async def connected(page: Page, url: str | None = None) -> None:
    if url is None:
        await page.reload()
    else:
        await page.goto(url)
    await expect(page.locator("#assistant")).to_have_attribute("data-keel-status", "connected", timeout=10_000)


async def fits(page: Page) -> None:
    """No sideways scroll: the page is no wider than the screen, and neither is the panel."""
    widths = await page.evaluate(
        """() => ({scroll: document.documentElement.scrollWidth, client: document.documentElement.clientWidth,
                   panel: document.querySelector('.keel-panel').getBoundingClientRect().right})"""
    )
    assert widths["scroll"] <= widths["client"], widths
    assert widths["panel"] <= widths["client"], widths


@pytest.mark.parametrize("width", [420, 360])
async def test_the_page_and_the_panel_fit_a_phone(browser: Browser, serve: Any, width: int) -> None:
    async for page in open_demo(browser, serve, width):
        await fits(page)
        title = page.locator("#title")
        await expect(title).to_have_text("Pick a lamp")
        one_line = "(e) => e.getBoundingClientRect().height < 1.5 * parseFloat(getComputedStyle(e).lineHeight)"
        assert await title.evaluate(one_line)  # one line, not one word a line
        await say(page, "a-word-with-no-space-to-break-at-" * 8)  # the panel wraps it, the page does not widen
        await expect(page.locator(".keel-assistant").last).to_contain_text("a-word-with-no-space")
        await page.get_by_role("button", name="Green lamp").click()
        await say(page, "order it")
        await expect(page.locator(".keel-approval")).to_have_count(1)
        await fits(page)
        await shot(page, f"demo-mobile-{width}")


async def test_a_reply_streams_in_over_several_frames(phone: Page) -> None:
    # every change of the newest reply's text, with the animation frame it showed in
    await phone.evaluate(
        """() => {
          window.frames_ = 0;
          const tick = () => { window.frames_ += 1; requestAnimationFrame(tick); };
          requestAnimationFrame(tick);
          window.growth = [];
          const log = document.querySelector('.keel-log');
          new MutationObserver(() => {
            const replies = log.querySelectorAll('.keel-assistant');
            const text = replies.length ? replies[replies.length - 1].textContent : '';
            window.growth.push([window.frames_, text.length]);
          }).observe(log, {childList: true, subtree: true, characterData: true});
        }"""
    )
    await say(phone, "hello")
    reply = phone.locator(".keel-assistant")
    await expect(reply).to_contain_text("You said: 'hel")
    await shot(phone, "demo-mobile-streaming")
    await expect(reply).to_have_count(1)
    await expect(reply).to_contain_text("3 page context entries")
    await expect(reply).to_contain_text("(Try 'what time is it' or 'add 2 and 3'.)")  # to its end
    growth: list[list[int]] = await phone.evaluate("window.growth")
    full = len(await reply.text_content() or "")
    lengths = [n for _, n in growth if n]
    assert lengths == sorted(lengths) and lengths[-1] == full  # it only grows, to the whole reply
    partial = {(frame, n) for frame, n in growth if 0 < n < full}
    assert len({n for _, n in partial}) >= 10, growth  # many pieces, not one
    assert len({frame for frame, _ in partial}) >= 5, growth  # shown in frames of their own
    await no_duplicates(phone)


async def test_the_approval_card_asks_in_words_and_an_approved_order_fills_the_cart(phone: Page) -> None:
    cart = phone.locator("#cart")
    await expect(cart).to_have_text("cart: 0 items")
    await phone.get_by_role("button", name="Green lamp").click()
    await say(phone, "order it")
    card = phone.locator(".keel-approval")
    await expect(card.locator(".keel-question")).to_have_text("Order the Green lamp?")
    await expect(card.locator("dt")).to_have_text(["item"])  # the arguments, below the question
    await expect(card.locator("dd")).to_have_text(["Green lamp"])
    await expect(card).not_to_contain_text("{")  # no JSON
    await fits(phone)
    await shot(phone, "demo-mobile-approval")
    await card.get_by_role("button", name="Approve").click()
    await expect(phone.locator(".keel-assistant").last).to_have_text(
        "The place_order tool says: ordered the Green lamp (pretend)"
    )
    await expect(cart).to_have_text("cart: 1 item")
    await shot(phone, "demo-mobile-ordered")

    await connected(phone)  # the conversation's events come again: the order is counted once
    await expect(phone.locator(".keel-approval")).to_have_attribute("data-decision", "approve")
    await expect(cart).to_have_text("cart: 1 item")

    await say(phone, "order it")  # a denied order is no order
    await phone.locator(".keel-approval").last.get_by_role("button", name="Deny").click()
    await expect(phone.locator(".keel-tool").last).to_contain_text("denied")
    await expect(phone.locator(".keel-assistant").last).to_contain_text("a person denied this call")
    await expect(cart).to_have_text("cart: 1 item")


async def test_a_reload_keeps_the_selected_lamp(phone: Page) -> None:
    await phone.get_by_role("button", name="Brass floor lamp").click()
    await expect(phone).to_have_url(f"{phone.url.split('#')[0]}#/products/3")

    await connected(phone)  # from the URL
    await expect(phone.locator("#title")).to_have_text("Brass floor lamp")
    await expect(phone.get_by_role("button", name="Brass floor lamp")).to_have_attribute("aria-pressed", "true")
    await say(phone, "what am I looking at?")  # the page and the conversation agree
    await expect(phone.locator(".keel-assistant").last).to_have_text(
        "You are looking at the Brass floor lamp (/products/3)."
    )

    await connected(phone, "/")  # no lamp in the URL: from storage
    await expect(phone.locator("#title")).to_have_text("Brass floor lamp")
    await expect(phone).to_have_url(f"{phone.url.split('#')[0]}#/products/3")

    await connected(phone, "/#/products/1")  # a link to a lamp wins over what was stored
    await expect(phone.locator("#title")).to_have_text("Blue lamp")
    await shot(phone, "demo-mobile-restored")

"""The demo agent works offline and keeps page context out of what it says (and so of history)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from app import load_agent


async def test_the_demo_answers_uses_its_tools_and_names_context_without_quoting_it(make_harness: Any) -> None:
    h = await make_harness(load_agent("app.demo:agent"))
    sid = await h.sessions.create("anon")
    hello = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "hello", {"page": "/secret/path"}), 10)
    assert hello.reply == (
        "You said: 'hello'. I can see 1 page context entry: page. (Try 'what time is it' or 'add 2 and 3'.)"
    )
    add = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "add 2 and 40"), 10)
    assert add.reply == "The add tool says: 42"
    clock = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "what time is it?"), 10)
    assert (clock.reply or "").startswith("The utc_time tool says: 20")
    assert not any("/secret/path" in i.text for i in await h.sessions.history(sid, "anon"))


async def test_the_demo_compacts_on_request_keeping_what_the_user_said(make_harness: Any) -> None:
    h = await make_harness(load_agent("app.demo:agent"))
    sid = await h.sessions.create("anon")
    for text in ("my name is Ada", "I like tea", "what now", "and then"):
        await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", text), 10)
    await h.sessions.compact(sid, "anon")
    async with asyncio.timeout(10):
        async for event in h.sessions.tail(sid, "0-0", heartbeat=1.0):
            if event is not None and event.type == "session.waiting":
                break
    history = await h.sessions.history(sid, "anon")
    assert history[0].kind == "summary" and history[0].text.endswith("my name is Ada; I like tea")
    assert history[1].kind == "runtime" and re.search(r"\ntoday: \d{4}-\d\d-\d\d$", history[1].text)
    assert [i.text for i in history[2:] if i.role == "user"] == ["what now", "and then"]

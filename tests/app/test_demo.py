"""The demo agent works offline, streams its replies at a readable pace, and keeps page context
out of what it says (and so of history)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from app import demo, load_agent
from harness.models import ModelRequest, TextDelta
from harness.types import Item


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


async def streamed(text: str, purpose: str = "turn") -> tuple[list[tuple[float, str]], str]:
    """The demo model's deltas for a user's `text`, each with when it came, and the reply's text."""
    request = ModelRequest(system="", tools=(), messages=[Item(id="i1", role="user", text=text)], purpose=purpose)
    loop = asyncio.get_running_loop()
    deltas: list[tuple[float, str]] = []
    async for event in demo.agent.model.stream(request):
        if isinstance(event, TextDelta):
            deltas.append((loop.time(), event.text))
        else:
            return deltas, event.text
    raise AssertionError("no reply")


async def test_the_demo_streams_its_replies_at_a_readable_pace_and_never_slowly() -> None:
    deltas, reply = await streamed("hello")
    assert "".join(d for _, d in deltas) == reply and len(deltas) >= 10
    assert all(len(d) <= demo.CHUNK for _, d in deltas)
    took = deltas[-1][0] - deltas[0][0]
    assert took >= 0.8 * demo.PACE_S * (len(deltas) - 1)  # text arriving, not one burst
    assert took < 2.0

    deltas, reply = await streamed("x" * 2_000)  # a long reply comes faster, as fast as a short one's end
    assert "".join(d for _, d in deltas) == reply and len(deltas) > 500
    assert deltas[-1][0] - deltas[0][0] < 2.0

    deltas, reply = await streamed("user: hello", purpose="compaction")  # nobody watches a summary come
    assert deltas == [] and reply == "Earlier the user said: hello"

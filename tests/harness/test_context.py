"""Invariant I1: page context is seen by every model call of its turn and by nothing else."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from harness import Agent, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall


def contexts(request: ModelRequest) -> list[str]:
    return [m.text for m in request.messages if m.kind in ("context", "sticky")]


def all_text(request: ModelRequest) -> str:
    return "\n".join(m.text for m in request.messages)


async def run_turn(h: Any, sid: str, text: str, context: Any = None) -> Any:
    res = await h.sessions.submit(sid, "anon", text, context)
    turn = await h.sessions.wait_turn(res, 10)
    assert turn.status == "completed", turn
    return turn


async def test_turn_context_is_seen_only_by_its_own_turn(make_harness: Any) -> None:
    model = ScriptedModel(lambda r: ModelReply(text="ok"))
    h = await make_harness(Agent(instructions="t", model=model))
    sid = await h.sessions.create("anon")
    for n in (1, 2, 3):
        await run_turn(h, sid, f"Turn {n}", f"CTX-{n}")
    for n, request in enumerate(model.requests, start=1):
        seen = [c for c in ("CTX-1", "CTX-2", "CTX-3") if c in all_text(request)]
        assert seen == [f"CTX-{n}"]
    history = await h.sessions.history(sid, "anon")
    assert [i.text for i in history] == ["Turn 1", "ok", "Turn 2", "ok", "Turn 3", "ok"]
    assert not any("CTX" in i.text for i in history)


async def test_prompt_size_stays_flat_over_50_turns_with_context(make_harness: Any) -> None:
    page = "x" * 2_000  # a large page state: if it leaked into history, prompts would grow by it each turn
    model = ScriptedModel(lambda r: ModelReply(text="ok"))
    h = await make_harness(Agent(instructions="t", model=model))
    sid = await h.sessions.create("anon")
    for n in range(50):
        await run_turn(h, sid, "hi", f"{page}-{n:02d}")
    sizes = [len(all_text(r)) for r in model.requests]
    growth = {b - a for a, b in itertools.pairwise(sizes)}
    assert growth == {len("hi") + len("ok") + 2}  # one user + one assistant item per turn, nothing else
    assert all(len(contexts(r)) == 1 for r in model.requests)
    assert sizes[-1] - sizes[0] < len(page)  # 49 turns of growth are smaller than one page of context


async def test_every_model_call_of_a_tool_turn_sees_its_context(make_harness: Any) -> None:
    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        return f"found {q}"

    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "user":
            return ModelReply(tool_calls=[ToolCall("lookup", {"q": "a"})])
        if r.messages[-1].tool_name == "lookup" and r.step == 1:
            return ModelReply(tool_calls=[ToolCall("lookup", {"q": "b"})])
        return ModelReply(text="done")

    model = ScriptedModel(script)
    h = await make_harness(Agent(instructions="t", tools=[lookup], model=model))
    sid = await h.sessions.create("anon")
    await run_turn(h, sid, "go", ["PAGE-A", "PAGE-B"])
    await run_turn(h, sid, "again")
    first, second = model.requests[:3], model.requests[3:]
    assert len(first) == 3 and len(second) == 3
    for r in first:
        assert contexts(r) == ["[page context]\nPAGE-A", "[page context]\nPAGE-B"]
    for r in second:
        assert "PAGE-" not in all_text(r)


async def test_keyed_context_replaces_by_key_and_null_removes(make_harness: Any) -> None:
    model = ScriptedModel(lambda r: ModelReply(text="ok"))
    h = await make_harness(Agent(instructions="t", model=model))
    sid = await h.sessions.create("anon")
    await run_turn(h, sid, "1", {"page": "/a", "doc": "D1"})
    await run_turn(h, sid, "2", {"page": "/b"})
    await run_turn(h, sid, "3")
    await run_turn(h, sid, "4", {"doc": None})
    seen = [contexts(r) for r in model.requests]
    assert seen[0] == ["[page context: doc]\nD1", "[page context: page]\n/a"]
    assert seen[1] == ["[page context: doc]\nD1", "[page context: page]\n/b"]
    assert seen[2] == seen[1]  # sticky: shown until replaced
    assert seen[3] == ["[page context: page]\n/b"]
    history = await h.sessions.history(sid, "anon")
    assert not any(i.kind != "message" and i.role == "user" for i in history)
    assert not any(t in i.text for i in history for t in ("/a", "/b", "D1"))


async def test_keyed_context_of_a_queued_message_waits_for_its_turn(make_harness: Any) -> None:
    """A message queued behind a running turn must not change what that turn sees."""

    release, started = asyncio.Event(), asyncio.Event()
    calls: list[list[str]] = []

    async def script(r: ModelRequest) -> ModelReply:
        calls.append(contexts(r))
        started.set()
        if len(calls) == 1:
            await release.wait()
        return ModelReply(text="ok")

    h = await make_harness(Agent(instructions="t", model=ScriptedModel(script)))
    sid = await h.sessions.create("anon")
    first = await h.sessions.submit(sid, "anon", "1", {"page": "/first"})
    await asyncio.wait_for(started.wait(), 5)
    second = await h.sessions.submit(sid, "anon", "2", {"page": "/second"})
    release.set()
    assert (await h.sessions.wait_turn(first, 10)).status == "completed"
    assert (await h.sessions.wait_turn(second, 10)).status == "completed"
    assert calls == [["[page context: page]\n/first"], ["[page context: page]\n/second"]]

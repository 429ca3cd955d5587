"""I6: a cache-stable prefix, and runtime-context snapshots that change history only when the
value changes (shown mid-run at the tail without being stored)."""

from __future__ import annotations

from typing import Any

from harness import Agent, tool
from harness.loop.runtime import HEADER
from harness.models import CachingScriptedModel, ModelReply, ModelRequest, ScriptedModel, ToolCall
from tests.events import env


async def run_turn(h: Any, sid: str, text: str, context: Any = None) -> Any:
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", text, context), 10)
    assert turn.status == "completed", turn
    return turn


def runtime_texts(items: list[Any]) -> list[str]:
    return [i.text for i in items if i.kind == "runtime"]


@tool
def lookup(q: str) -> str:
    """Look something up in the product's catalogue."""
    return f"found {q}"


async def test_fifty_turns_keep_the_prefix_and_hit_the_cache(make_harness: Any) -> None:
    branch = {"name": "main"}

    def git_branch() -> str:
        return branch["name"]

    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "user" and r.messages[-1].text.endswith("look"):
            return ModelReply(tool_calls=[ToolCall("lookup", {"q": "x"})])
        return ModelReply(text=f"answer to step {r.step}")

    model = CachingScriptedModel(script)
    agent = Agent(
        instructions="You are a careful product assistant. " * 20,
        tools=[lookup],
        model=model,
        runtime_context=[git_branch],
    )
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    usages: list[Any] = []
    for n in range(50):
        if n % 10 == 0:
            branch["name"] = f"feature-{n // 10}"
        text = f"question {n}" + (" look" if n % 3 == 0 else "")
        turn = await run_turn(h, sid, text, {"page": f"/products/{n} selection={n * 7}"})
        usages.append([env(e)["data"] for e in turn.events if e.type == "usage.recorded"])
    assert len(set(model.prefixes)) == 1  # tools + system: the same bytes in every request
    assert len(model.prefixes) == len(model.requests) == sum(len(u) for u in usages)
    after_first = [u for turn in usages[1:] for u in turn]
    cached = sum(u["cached_tokens"] for u in after_first)
    total = sum(u["input_tokens"] for u in after_first)
    assert cached / total >= 0.9, (cached, total)
    history = await h.sessions.history(sid, "anon")
    assert runtime_texts(history) == [f"{HEADER}\ngit_branch: feature-{k}" for k in range(5)]  # only on change
    assert not any("/products/" in i.text for i in history)  # page context never stored
    # the breakpoint after history is where the next request's prefix ends
    r1, r2 = model.requests[-2], model.requests[-1]
    k = r1.cache_breakpoints[-1]
    assert r1.messages[:k] == r2.messages[:k] and r1.messages[k].kind == "sticky"


async def test_snapshot_is_appended_only_when_the_value_changes(make_harness: Any) -> None:
    values: dict[str, str | None] = {"plan": "free", "day": None}

    def plan() -> str | None:
        return values["plan"]

    async def day() -> str | None:
        return values["day"]

    model = ScriptedModel(lambda r: ModelReply(text="ok"))
    h = await make_harness(Agent(instructions="t", model=model, runtime_context=[plan, day]))
    sid = await h.sessions.create("anon")
    await run_turn(h, sid, "one")
    await run_turn(h, sid, "two")
    values["day"] = "2026-11-30"
    await run_turn(h, sid, "three")
    await run_turn(h, sid, "four")
    values["plan"] = None
    values["day"] = None
    await run_turn(h, sid, "five")
    history = await h.sessions.history(sid, "anon")
    assert [(i.kind, i.text.splitlines()[-1]) for i in history if i.role == "user"] == [
        ("runtime", "plan: free"),
        ("message", "one"),
        ("message", "two"),
        ("runtime", "day: 2026-11-30"),
        ("message", "three"),
        ("message", "four"),
        ("runtime", "(none)"),  # the values went away: said once, so the model stops relying on them
        ("message", "five"),
    ]
    # the snapshot sits before the user message, and in the request before page context
    first = model.requests[0].messages
    assert [m.kind for m in first] == ["runtime", "message"]


async def test_a_failing_provider_announces_nothing(make_harness: Any) -> None:
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("git not found")
        return "main"

    h = await make_harness(
        Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="ok")), runtime_context=[flaky])
    )
    sid = await h.sessions.create("anon")
    for text in ("a", "b", "c"):
        await run_turn(h, sid, text)
    assert runtime_texts(await h.sessions.history(sid, "anon")) == [f"{HEADER}\nflaky: main"]


async def test_a_change_mid_run_is_shown_at_the_tail_and_stored_with_the_next_message(make_harness: Any) -> None:
    branch = {"name": "main"}

    def git_branch() -> str:
        return branch["name"]

    @tool
    def checkout(name: str) -> str:
        """Check out a branch."""
        branch["name"] = name
        return f"on {name}"

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.kind == "message" and last.text == "switch":
            return ModelReply(tool_calls=[ToolCall("checkout", {"name": "dev"})])
        if last.role == "tool" or (last.kind == "runtime" and r.step > 0):
            return ModelReply(tool_calls=[ToolCall("lookup", {"q": "y"})]) if r.step == 1 else ModelReply(text="done")
        return ModelReply(text="ok")

    model = ScriptedModel(script)
    h = await make_harness(Agent(instructions="t", tools=[checkout, lookup], model=model, runtime_context=[git_branch]))
    sid = await h.sessions.create("anon")
    await run_turn(h, sid, "switch")
    after_checkout, after_lookup = model.requests[1], model.requests[2]
    for r in (after_checkout, after_lookup):
        assert r.messages[-1].kind == "runtime" and r.messages[-1].text.endswith("git_branch: dev")
        assert r.messages[-2].role == "tool"
    assert model.requests[0].messages[0].text.endswith("git_branch: main")
    stored = await h.sessions.history(sid, "anon")
    assert runtime_texts(stored) == [f"{HEADER}\ngit_branch: main"]  # the mid-run value was not written
    await run_turn(h, sid, "next")
    stored = await h.sessions.history(sid, "anon")
    assert runtime_texts(stored) == [f"{HEADER}\ngit_branch: main", f"{HEADER}\ngit_branch: dev"]
    assert stored[-3].kind == "runtime" and stored[-2].text == "next"  # persisted with the next message

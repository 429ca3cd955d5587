"""keel's `/v1/agui` driven by the real AG-UI client: @ag-ui/client's HttpAgent from the pinned
packages in tests/js (tests/js/agui.mjs). Every event passed the client's schema enforcement
and its verifier (a failure there rejects the run, and the script fails), without a warning;
what the agent then holds is what a page built on it would show."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.frontend_agent import frontend_agent
from tests.jsclient import NodeScript, run_script, skip_without_node

pytestmark = skip_without_node()

SLOW_REPLY = "That took a while, but here it is: the slow reply."


@pytest.fixture
async def keel(serve: Any) -> Any:
    agent, runs, gates = frontend_agent()
    live = await serve(agent)
    c = live.client()

    async def session() -> str:
        sid: str = (await c.post("/v1/sessions")).json()["session_id"]
        return sid

    yield live, c, session, runs, gates
    await c.aclose()


def types(run: dict[str, Any]) -> list[str]:
    return [e["type"] for e in run["events"]]


def without_deltas(run: dict[str, Any]) -> list[str]:
    return [t for t in types(run) if t != "TEXT_MESSAGE_CONTENT"]


def texts(done: dict[str, Any]) -> list[str]:
    """The agent's assistant text messages, in order."""
    return [m["content"] for m in done["messages"] if m["role"] == "assistant" and m.get("content")]


def tool_calls(done: dict[str, Any]) -> list[dict[str, Any]]:
    return [tc for m in done["messages"] if m["role"] == "assistant" for tc in m.get("toolCalls") or []]


def tool_results(done: dict[str, Any]) -> dict[str, str]:
    """The agent's tool messages: tool call id -> content."""
    return {m["toolCallId"]: m["content"] for m in done["messages"] if m["role"] == "tool"}


def clean(done: dict[str, Any]) -> None:
    """No warning, no failed run, every run ended (the verifier saw it whole)."""
    assert done["warnings"] == [], done["warnings"]
    for run in done["runs"]:
        assert run["failed"] is None, run
        assert types(run)[0] == "RUN_STARTED", run
        assert types(run)[-1] in ("RUN_FINISHED", "RUN_ERROR"), run


async def history(c: Any, sid: str) -> list[tuple[str, str]]:
    items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
    return [(i["role"], i["text"]) for i in items]


async def test_agui_client_text(keel: Any) -> None:
    live, c, session, _, _ = keel
    sid = await session()
    done = await run_script("agui.mjs", "text", live.base, sid)
    clean(done)
    (run,) = done["runs"]
    assert run["outcome"] == "success" and run["error"] is None
    assert types(run)[-1] == "RUN_FINISHED" and run["events"][-1]["outcome"] == {"type": "success"}
    assert run["events"][0]["threadId"] == sid and run["runId"] == "run-1"
    assert types(run).count("TEXT_MESSAGE_CONTENT") > 1  # it streamed
    assert [m["role"] for m in done["messages"]] == ["user", "assistant"]
    assert texts(done) == ["Echo: hello"]
    assert done["messages"][0]["id"] == "u-1"
    assert await history(c, sid) == [("user", "hello"), ("assistant", "Echo: hello")]


async def test_agui_client_tools(keel: Any) -> None:
    live, c, session, runs, _ = keel
    sid = await session()
    done = await run_script("agui.mjs", "tools", live.base, sid)
    clean(done)
    (run,) = done["runs"]
    assert run["outcome"] == "success" and run["pending"] == []  # (every call got its result)
    (call,) = tool_calls(done)
    assert call["function"]["name"] == "weather"
    assert call["function"]["arguments"] == '{"city":"Rome"}'
    assert tool_results(done) == {call["id"]: "sunny in Rome"}
    assert "".join(texts(done)) == "Looking it up.Done: sunny in Rome"
    assert list(runs.values()) == [1]
    assert (await history(c, sid))[-1] == ("assistant", "Done: sunny in Rome")


@pytest.mark.parametrize("answer", ["approve", "deny", "cancel"])
async def test_agui_client_interrupt_and_resume(keel: Any, answer: str) -> None:
    live, c, session, runs, _ = keel
    sid = await session()
    done = await run_script("agui.mjs", answer, live.base, sid)
    clean(done)
    asked, rest = done["runs"]
    assert asked["outcome"] == "interrupt"
    (interrupt,) = asked["interrupts"]
    (call,) = tool_calls(done)
    assert interrupt["reason"] == "tool_approval" and interrupt["toolCallId"] == call["id"]
    assert call["function"]["name"] == "pay" and call["function"]["arguments"] == '{"amount":7}'
    assert "TOOL_CALL_START" in types(asked) and "TOOL_CALL_RESULT" not in types(asked)
    # the resumed run: the rest of the turn, the call it announced not announced again
    assert rest["outcome"] == "success" and done["pendingInterrupts"] == []
    assert "TOOL_CALL_START" not in types(rest)
    results = tool_results(done)
    assert list(results) == [call["id"]]
    if answer == "approve":
        assert results[call["id"]] == "paid 7"
        assert list(runs.values()) == [1]
        assert "".join(texts(done)) == "I will pay.Done: paid 7"
        assert (await history(c, sid))[-1] == ("assistant", "Done: paid 7")
    else:
        said = "error: a person denied this call" + (": not today" if answer == "deny" else "")
        assert results[call["id"]] == said  # (the reason the deny gave; a cancel gives none)
        assert not runs  # the tool never ran
        assert texts(done) == ["I will pay.", f"Done: {said}"]
    assert (await c.get(f"/v1/sessions/{sid}")).json()["status"] == "idle"


async def test_agui_client_reruns_the_thread_after_the_page_dropped_mid_turn(keel: Any) -> None:
    live, c, session, _, gates = keel
    sid = await session()
    script = await NodeScript.start("agui.mjs", "drop-and-resume", live.base, sid)
    try:
        await script.until("resumed")
        # the turn still waits on its model: what follows comes live, on the second run
        await asyncio.wait_for(gates.slow_began.wait(), 10)
        assert await history(c, sid) == []
        assert (await c.get(f"/v1/sessions/{sid}")).json()["status"] == "running"
        await script.until("kept-alive")  # (a keep-alive comment while it waits: taken quietly)
        gates.slow.set()
        script.say()
        done = await script.until("done")
    finally:
        await script.close()
    clean(done)
    dropped, again, replayed = done["runs"]
    assert types(dropped) == ["RUN_STARTED", "RUN_ERROR"]
    assert dropped["error"]["code"] == "abort"  # (the client's own, for its aborted fetch)
    assert again["outcome"] == "success" and again["keepAlives"] >= 1
    assert "TEXT_MESSAGE_START" in types(again)
    assert texts(done) == [SLOW_REPLY]  # the reply once
    assert [m["role"] for m in done["messages"]] == ["user", "assistant"]
    # a page reloaded with the user's message only: the committed turn replayed from its start
    assert replayed["outcome"] == "success" and types(replayed)[:2] == ["RUN_STARTED", "TEXT_MESSAGE_START"]
    assert without_deltas(replayed) == without_deltas(again)  # (its text in one delta now)
    assert [(m["role"], m.get("content")) for m in done["reloaded"]] == [("user", "slow"), ("assistant", SLOW_REPLY)]
    assert done["reloaded"][1]["id"] == done["messages"][1]["id"]  # (keel's item id, both times)
    # one turn: the message posted again (twice) was never a new one
    assert await history(c, sid) == [("user", "slow"), ("assistant", SLOW_REPLY)]

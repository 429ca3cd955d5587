"""Prompt-cache health: the share of input tokens read from the cache, by agent and model, and
the cache-bust detector. An agent whose system prompt gets a runtime value put into it by hand
(what seed 003 warns about: one volatile line in the cached prefix makes every request a cache
write) moves the bust counter and logs a warning naming the session and what changed; a change
of the tools is told apart; the demo agent, turn after turn, busts nothing."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from app.demo import agent as demo_agent
from harness import Agent, tool
from harness.models import CachingScriptedModel, ModelReply, ModelRequest, ScriptedModel
from harness.tools.toolbox import Toolbox


def reply(r: ModelRequest) -> ModelReply:
    return ModelReply(text="ok")


async def turn(h: Any, sid: str, text: str) -> None:
    result = await h.sessions.submit_and_wait(sid, "o", text, context=None, message_id=None, timeout=30)
    assert result.status == "completed", result


async def test_a_runtime_value_in_the_system_prompt_is_a_cache_bust(
    make_harness: Any, caplog: pytest.LogCaptureFixture
) -> None:
    agent = Agent(name="clocked", instructions="You help. It is 10:00.", model=CachingScriptedModel(reply))
    h = await make_harness(agent)
    sid = await h.sessions.create("o")
    await turn(h, sid, "one")
    await turn(h, sid, "two")
    assert h.stats.cache_busts == {}  # the same prefix: read from the cache
    stats = h.stats
    assert stats.cached_tokens[("clocked", "scripted")] > 0
    assert stats.prompt_tokens[("clocked", "scripted")] > stats.cached_tokens[("clocked", "scripted")]

    agent.instructions = "You help. It is 10:01."  # a clock in the instructions, by hand
    with caplog.at_level(logging.WARNING, logger="keel.model"):
        await turn(h, sid, "three")
    assert stats.cache_busts == {("clocked", "scripted", "system"): 1}
    warned = [r.getMessage() for r in caplog.records if "cached prefix changed" in r.getMessage()]
    assert len(warned) == 1 and sid in warned[0] and "(system)" in warned[0]


async def test_a_changed_tool_list_is_told_apart(make_harness: Any) -> None:
    @tool
    def look(q: str) -> str:
        """Look something up."""
        return q

    agent = Agent(name="tooled", instructions="t", model=ScriptedModel(reply))
    h = await make_harness(agent)
    sid = await h.sessions.create("o")
    await turn(h, sid, "one")
    agent.toolbox = Toolbox.of([look])  # (a tool list that changed, as an MCP server's may)
    await turn(h, sid, "two")
    assert h.stats.cache_busts == {("tooled", "scripted", "tools"): 1}


async def test_the_demo_agent_busts_nothing(make_harness: Any) -> None:
    h = await make_harness(demo_agent)
    sid = await h.sessions.create("o")
    for text in ("hi", "add 2 and 40", "what is in my cart?"):
        await turn(h, sid, text)
    assert h.stats.cache_busts == {}
    assert sum(h.stats.prompt_tokens.values()) > 0

from __future__ import annotations

import msgspec
import pytest

from harness import Agent, ToolContext, tool
from harness.errors import ToolError
from harness.models import ModelReply, ScriptedModel, ToolCall
from harness.tools.calls import RESULT_MAX_CHARS, run_call
from harness.tools.toolbox import Toolbox


def test_schema_comes_from_the_signature_and_docstring() -> None:
    @tool
    def search(query: str, limit: int = 5, ctx: ToolContext | None = None) -> list[str]:
        """Search the docs."""
        return []

    @tool(name="find", approval=True)
    def search2(query: str, ctx: ToolContext) -> list[str]:
        """Find."""
        return []

    assert search.spec.name == "search"
    assert search.spec.description == "Search the docs."
    params = search.spec.parameters
    assert params["properties"]["query"] == {"type": "string"}
    assert params["properties"]["limit"] == {"type": "integer", "default": 5}
    assert params["required"] == ["query"]
    assert params["additionalProperties"] is False
    assert search2.name == "find" and search2.needs_approval({}) is True
    assert "ctx" not in search2.spec.parameters["properties"]
    with pytest.raises(msgspec.ValidationError):
        search.validate({"query": 3})
    with pytest.raises(msgspec.ValidationError):
        search.validate({"query": "a", "extra": 1})


def test_agent_refuses_two_tools_with_one_name() -> None:
    def a() -> None:
        """A."""

    with pytest.raises(ValueError, match="two tools"):
        Agent(instructions="", model=ScriptedModel(lambda r: ModelReply()), tools=[a, tool(a)])


def test_tool_specs_are_the_same_objects_every_time() -> None:
    def a(x: int) -> int:
        """A."""
        return x

    agent = Agent(instructions="", model=ScriptedModel(lambda r: ModelReply()), tools=[a])
    assert msgspec.json.encode(agent.tool_specs) == msgspec.json.encode(agent.tool_specs)


async def test_a_result_past_the_cap_is_cut_with_a_note_and_an_error_keeps_its_message() -> None:
    @tool
    def big() -> str:
        """A long result."""
        return "x" * (RESULT_MAX_CHARS + 5)

    @tool
    def fails() -> str:
        """A tool that says why it failed."""
        raise ToolError("the printer is on fire")

    ctx = ToolContext("ses_1", "turn_1", "call_1")
    text, is_error = await run_call(Toolbox.of([big, fails]).tools, ToolCall("big", {}, "call_1"), ctx)
    assert not is_error and text == "x" * RESULT_MAX_CHARS + "\n[... 5 more characters cut ...]"
    text, is_error = await run_call(Toolbox.of([big, fails]).tools, ToolCall("fails", {}, "call_2"), ctx)
    assert is_error and text == "error: the printer is on fire"

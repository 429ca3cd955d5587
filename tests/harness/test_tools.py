from __future__ import annotations

import msgspec
import pytest

from harness import Agent, ToolContext, tool
from harness.models import ModelReply, ScriptedModel


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

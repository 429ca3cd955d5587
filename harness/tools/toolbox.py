"""The tools a turn may call: `Toolbox`, and `ToolPort`, what the loop needs of any tool.

A tool is a tool whatever serves it: a Python function (`harness.tools.Tool`) or an MCP server's
(`harness.tools.mcp.McpTool`). A Toolbox holds them by name and their specs in the order the
model is shown them; it is made once and kept while nothing changes, so every request of a turn
(and of every turn until the tools change) carries the same spec objects, the same bytes (I6).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from harness.models.base import ToolSpec
from harness.tools import ToolContext


class ToolPort(Protocol):
    """A tool as the loop calls it. `interruptible`: a cancel of the turn stops a call of it at
    once (an MCP server's is told); otherwise the call finishes first."""

    name: str
    spec: ToolSpec
    interruptible: bool

    def needs_approval(self, arguments: dict[str, Any]) -> bool: ...

    async def invoke(self, arguments: dict[str, Any], context: ToolContext) -> Any:
        """The call's value (text, or anything JSON encodes); raises for an error result."""
        ...


@dataclass(frozen=True)
class Toolbox:
    tools: Mapping[str, ToolPort] = field(default_factory=dict)
    specs: tuple[ToolSpec, ...] = ()

    @classmethod
    def of(cls, tools: Iterable[ToolPort]) -> Toolbox:
        """The tools in this order; two of one name are an error."""
        by_name: dict[str, ToolPort] = {}
        for t in tools:
            if t.name in by_name:
                raise ValueError(f"two tools are named {t.name!r}")
            by_name[t.name] = t
        return cls(by_name, tuple(t.spec for t in by_name.values()))

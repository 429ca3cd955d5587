"""Agent: the definition of what runs a session's turns. Immutable once built."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from harness.models.base import Model, ToolSpec
from harness.tools import Tool


class Agent:
    """`Agent(instructions=..., tools=[fn, ...], model=ScriptedModel(fn))`.

    `max_steps` bounds the model calls of one turn; past it the turn fails with `max_steps`.
    """

    def __init__(
        self,
        *,
        instructions: str,
        model: Model,
        tools: Iterable[Tool | Callable[..., Any]] = (),
        name: str = "agent",
        max_steps: int = 16,
    ) -> None:
        if max_steps < 1:
            raise ValueError("max_steps must be at least 1")
        self.name = name
        self.instructions = instructions
        self.model = model
        self.max_steps = max_steps
        built = [t if isinstance(t, Tool) else Tool(t) for t in tools]
        self.tools: dict[str, Tool] = {}
        for t in built:
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        # Built once: the same objects (and so the same bytes) in every request of every turn (I6).
        self.tool_specs: tuple[ToolSpec, ...] = tuple(t.spec for t in built)

"""Agent: the definition of what runs a session's turns. Immutable once built."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from harness.loop.compaction import Compaction
from harness.loop.prompt import InputCallback
from harness.loop.runtime import RuntimeContext, RuntimeFn
from harness.models.base import Model, ToolSpec
from harness.models.spec import resolve
from harness.tools import Tool
from harness.tools.mcpconfig import McpServer
from harness.tools.todo import todo_tool
from harness.tools.toolbox import Toolbox


class Agent:
    """`Agent(instructions=..., tools=[fn, ...], model=ScriptedModel(fn))`, or with a real model:
    `model="anthropic:claude-sonnet-4-5"`, `"openai:gpt-5"`, `"openai-chat:<model>"` (see
    `harness.models.spec`), or an `AnthropicModel(...)` / `OpenAIModel(...)` of your own.

    - `max_steps` bounds the model calls of one turn; past it the turn fails with `max_steps`.
    - `runtime_context=[fn, ...]`: providers of volatile facts (branch, plan, date), each
      returning a short string or None; shown as snapshots in history, never in the system
      prompt (see `harness.loop.runtime`).
    - `input_callback(history, new_input) -> list[Item]`: reshapes what the model is shown;
      never what is stored (see `harness.loop.prompt`).
    - `context_window` (tokens) turns on automatic compaction, configured by `compaction`
      (see `harness.loop.compaction`); a manual compact uses `compaction` either way.
    - `todo=True` gives the model the built-in `todo` tool (see `harness.tools.todo`).
    - `model_retries`: how many more attempts a model call gets after one that may succeed
      next time (rate limited, overloaded, unreachable, a cut or idle stream); see
      `harness.loop.modelcall`.
    - `mcp_servers=[McpServer.stdio(...), McpServer.http(...)]`: MCP servers whose tools the
      agent has too, as `<server>__<tool>` (see `harness.tools.mcp`).
    """

    def __init__(
        self,
        *,
        instructions: str,
        model: Model | str,
        tools: Iterable[Tool | Callable[..., Any]] = (),
        name: str = "agent",
        max_steps: int = 16,
        runtime_context: Sequence[RuntimeFn] = (),
        input_callback: InputCallback | None = None,
        context_window: int | None = None,
        compaction: Compaction | None = None,
        todo: bool = False,
        model_retries: int = 3,
        mcp_servers: Sequence[McpServer] = (),
    ) -> None:
        if max_steps < 1:
            raise ValueError("max_steps must be at least 1")
        if context_window is not None and context_window < 1:
            raise ValueError("context_window must be a positive number of tokens")
        self.name = name
        self.instructions = instructions
        self.model = resolve(model) if isinstance(model, str) else model
        self.max_steps = max_steps
        if model_retries < 0:
            raise ValueError("model_retries must be 0 or more")
        self.model_retries = model_retries
        self.runtime = RuntimeContext(runtime_context)
        self.input_callback = input_callback
        self.context_window = context_window
        self.compaction = compaction or Compaction()
        built = [t if isinstance(t, Tool) else Tool(t) for t in tools]
        if todo:
            built.append(todo_tool())
        self.tools: dict[str, Tool] = {}
        for t in built:
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        # Built once: the same objects (and so the same bytes) in every request of every turn (I6).
        self.toolbox = Toolbox.of(built)
        self.tool_specs: tuple[ToolSpec, ...] = self.toolbox.specs
        self.mcp_servers: tuple[McpServer, ...] = ()
        self._add_mcp(mcp_servers)

    def _add_mcp(self, servers: Sequence[McpServer]) -> None:
        names = [s.name for s in (*self.mcp_servers, *servers)]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"two MCP servers are named {name!r}")
        self.mcp_servers = (*self.mcp_servers, *servers)

    def with_mcp(self, servers: Sequence[McpServer]) -> Agent:
        """The same agent with these MCP servers' tools too (`KEEL_MCP_CONFIG` adds its servers
        to the configured agent)."""
        other = copy.copy(self)
        other._add_mcp(servers)
        return other

    def with_model(self, model: Model | str) -> Agent:
        """The same agent on another model (`KEEL_MODEL` puts the configured agent on it)."""
        other = copy.copy(self)
        other.model = resolve(model) if isinstance(model, str) else model
        return other

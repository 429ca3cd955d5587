"""The model port: what the loop hands a model and what it gets back."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec

from harness.types import Item, ToolCall, Usage


class ToolSpec(msgspec.Struct, frozen=True):
    """A tool as a model sees it: name, description, JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]


class ModelRequest(msgspec.Struct, frozen=True):
    """Everything one model call sees. `messages` is history + page context + this turn."""

    system: str
    tools: tuple[ToolSpec, ...]
    messages: list[Item]
    session_id: str = ""
    turn_id: str = ""
    step: int = 0


class ModelReply(msgspec.Struct, frozen=True):
    text: str = ""
    tool_calls: list[ToolCall] = []
    usage: Usage | None = None


@runtime_checkable
class Model(Protocol):
    """A language model. Implementations: ScriptedModel (tests, demo); provider adapters later."""

    async def complete(self, request: ModelRequest) -> ModelReply: ...

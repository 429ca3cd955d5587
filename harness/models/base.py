"""The model port: what the loop hands a model and what it gets back."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol, runtime_checkable

import msgspec

from harness.types import Item, ToolCall, Usage


class ToolSpec(msgspec.Struct, frozen=True):
    """A tool as a model sees it: name, description, JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]


class ModelRequest(msgspec.Struct, frozen=True):
    """Everything one model call sees. `messages` is history + page context + this turn.

    `cache_breakpoints` says where a provider with prompt caching should mark the end of a
    stable prefix: 0 is the end of the tools + system block (the same bytes in every request of
    the session), k > 0 the end of `messages[k - 1]` (the last item of durable history before
    this turn, which the next turn's request repeats unchanged). `purpose` is "turn" for a
    turn's model call and "compaction" for a summary of older turns."""

    system: str
    tools: tuple[ToolSpec, ...]
    messages: list[Item]
    session_id: str = ""
    turn_id: str = ""
    step: int = 0
    cache_breakpoints: tuple[int, ...] = (0,)
    purpose: str = "turn"


class ModelReply(msgspec.Struct, frozen=True):
    text: str = ""
    tool_calls: list[ToolCall] = []
    usage: Usage | None = None
    provider: dict[str, Any] | None = None  # opaque provider data, kept on the assistant item


class TextDelta(msgspec.Struct, frozen=True):
    """A piece of the reply's text, as the provider generates it."""

    text: str


ModelEvent = TextDelta | ModelReply


@runtime_checkable
class Model(Protocol):
    """A language model. `stream` yields the reply's text as it is generated (any number of
    `TextDelta`s, possibly none), then the whole `ModelReply`, last. Implementations:
    ScriptedModel and CachingScriptedModel (tests, demo); provider adapters."""

    def stream(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]: ...


async def complete(model: Model, request: ModelRequest) -> ModelReply:
    """The reply, for callers that show no deltas (a summary call): the stream drained."""
    reply: ModelReply | None = None
    async for event in model.stream(request):
        if isinstance(event, ModelReply):
            reply = event
    if reply is None:
        raise RuntimeError(f"{type(model).__name__}.stream ended without a ModelReply")
    return reply

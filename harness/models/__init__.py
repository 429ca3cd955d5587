"""Model port and implementations."""

from harness.models.base import Model, ModelEvent, ModelReply, ModelRequest, TextDelta, ToolSpec, complete
from harness.models.caching import CachingScriptedModel
from harness.models.scripted import ScriptedModel
from harness.types import Item, ToolCall, Usage

__all__ = [
    "CachingScriptedModel",
    "Item",
    "Model",
    "ModelEvent",
    "ModelReply",
    "ModelRequest",
    "ScriptedModel",
    "TextDelta",
    "ToolCall",
    "ToolSpec",
    "Usage",
    "complete",
]

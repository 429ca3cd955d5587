"""Model port and implementations."""

from harness.models.base import Model, ModelReply, ModelRequest, ToolSpec
from harness.models.caching import CachingScriptedModel
from harness.models.scripted import ScriptedModel
from harness.types import Item, ToolCall, Usage

__all__ = [
    "CachingScriptedModel",
    "Item",
    "Model",
    "ModelReply",
    "ModelRequest",
    "ScriptedModel",
    "ToolCall",
    "ToolSpec",
    "Usage",
]

"""Token estimates: the one rough measure keel uses where no provider counted.

Token estimates: one rough measure (4 characters a token) used everywhere keel has no
provider count, so estimates of different requests can be compared and subtracted."""

from __future__ import annotations

from collections.abc import Iterable

from harness.models.base import ModelRequest, ToolSpec
from harness.types import Item


def estimate_tokens(text: str) -> int:
    return (len(text) + 3) // 4


def item_tokens(item: Item) -> int:
    n = estimate_tokens(item.text) + 4
    for call in item.tool_calls:
        n += estimate_tokens(call.name) + 8 + len(call.arguments) * 4
    return n


def items_tokens(items: Iterable[Item]) -> int:
    return sum(item_tokens(i) for i in items)


def prefix_tokens(system: str, tools: Iterable[ToolSpec]) -> int:
    """The tools + system block."""
    n = estimate_tokens(system)
    for spec in tools:
        n += estimate_tokens(spec.name) + estimate_tokens(spec.description) + 8
    return n


def request_tokens(request: ModelRequest) -> int:
    return prefix_tokens(request.system, request.tools) + items_tokens(request.messages)

"""The built-in todo list tool.

The built-in todo list: a `todo` tool the model calls with its whole list. Its state lives in
the session's history (the newest successful `todo` result, or the list compaction re-injected
after a summary), so it is committed with the step that set it, survives any crash, and is
restored after compaction. `clear` drops it with the rest of the model's context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

from harness.tools import Tool
from harness.types import Item

HEADER = "[todo list]"
_MARK = {"pending": "[ ]", "in_progress": "[~]", "done": "[x]"}


class TodoItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    text: Annotated[str, msgspec.Meta(min_length=1, max_length=500)]
    status: Literal["pending", "in_progress", "done"] = "pending"


def todo(items: Annotated[list[TodoItem], msgspec.Meta(max_length=50)]) -> str:
    """Replace your todo list with `items` (each a text and a status: pending, in_progress or
    done). Send the whole list every time. Use it to plan and track multi-step work."""
    return render(items)


def render(items: Sequence[TodoItem]) -> str:
    lines = [f"- {_MARK[i.status]} {i.text}" for i in items]
    return HEADER + "\n" + ("\n".join(lines) if lines else "(empty)")


def todo_tool() -> Tool:
    return Tool(todo)


def newest_todo(items: Sequence[Item]) -> str | None:
    """The todo list as the model last saw it set, or None if it never was."""
    for item in reversed(items):
        if item.kind == "todo":
            return item.text
        if item.role == "tool" and item.tool_name == "todo" and not item.is_error:
            return item.text
    return None


def todo_item(turn_id: str, text: str, suffix: str) -> Item:
    return Item(id=f"it_{turn_id}_{suffix}", role="user", text=text, kind="todo", turn_id=turn_id)

"""One tool call of a turn: its approval check, its run, its result item.

One tool call of a turn: whether it needs a person's approval, running it, and the history
item that carries its result (every call gets one: run, refused or cancelled)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from harness.errors import ToolError
from harness.ids import request_id
from harness.tools import ToolContext
from harness.tools.toolbox import ToolPort
from harness.types import Answer, Item, ToolCall

log = logging.getLogger("keel.turn")
_enc = msgspec.json.Encoder()
RESULT_MAX_CHARS = 100_000  # of one call's result: the rest is cut (a result is history, every turn's)


def denial(answers: Mapping[str, Answer | None], call: ToolCall) -> Answer | None:
    """The answer that refuses `call`, if one does (None: it runs: not gated, or approved)."""
    answer = answers.get(request_id(call.id or ""))
    return answer if answer is not None and answer.decision != "approve" else None


def needs_approval(tools: Mapping[str, ToolPort], call: ToolCall) -> bool:
    tool = tools.get(call.name)
    if tool is None:
        return False  # answered with an error result; nothing runs
    try:
        return tool.needs_approval(call.arguments)
    except Exception:
        log.warning("approval check of %s failed; asking a person", call.name, exc_info=True)
        return True  # when in doubt, ask


async def run_call(tools: Mapping[str, ToolPort], call: ToolCall, context: ToolContext) -> tuple[str, bool]:
    """The call's result text and whether it is an error (a tool's failure is a result the
    model sees, not a failed turn), at most RESULT_MAX_CHARS of it."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: there is no tool named {call.name!r}", True
    try:
        value = await tool.invoke(call.arguments, context)
    except asyncio.CancelledError:
        raise
    except msgspec.ValidationError as exc:
        return capped(f"error: invalid arguments for {call.name}: {exc}"), True
    except ToolError as exc:  # (an error result the tool's server made: its text as it said it)
        return capped(f"error: {exc.message}"), True
    except Exception as exc:
        return capped(f"error: {type(exc).__name__}: {exc}"), True
    return capped(result_text(value)), False


def capped(text: str) -> str:
    """`text`, or its first RESULT_MAX_CHARS characters and a note of how many were cut."""
    if len(text) <= RESULT_MAX_CHARS:
        return text
    return f"{text[:RESULT_MAX_CHARS]}\n[... {len(text) - RESULT_MAX_CHARS} more characters cut ...]"


def result_item(turn_id: str, call: ToolCall, text: str, *, is_error: bool) -> Item:
    """The history item of a call's result; its id follows from the call id (stable on re-run)."""
    return Item(
        id=f"it_{call.id}_r",
        role="tool",
        text=text,
        kind="tool_result",
        turn_id=turn_id,
        tool_call_id=call.id,
        tool_name=call.name,
        is_error=is_error,
    )


def result_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return _enc.encode(value).decode()
    except TypeError:
        return str(value)

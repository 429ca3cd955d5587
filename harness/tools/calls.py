"""One tool call of a turn: its approval check, its run, its result item.

One tool call of a turn: whether it needs a person's approval, running it, and the history
item that carries its result (every call gets one: run, refused or cancelled)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from harness.tools import Tool, ToolContext
from harness.types import Answer, Item, ToolCall

log = logging.getLogger("keel.turn")
_enc = msgspec.json.Encoder()


def request_id(call_id: str) -> str:
    """A call's approval request id: derived from the committed call id, so it is the same
    after any crash or retry (I2, I3)."""
    return f"req_{call_id}"


def denial(answers: Mapping[str, Answer | None], call: ToolCall) -> Answer | None:
    """The answer that refuses `call`, if one does (None: it runs: not gated, or approved)."""
    answer = answers.get(request_id(call.id or ""))
    return answer if answer is not None and answer.decision != "approve" else None


def needs_approval(tools: Mapping[str, Tool], call: ToolCall) -> bool:
    tool = tools.get(call.name)
    if tool is None:
        return False  # answered with an error result; nothing runs
    try:
        return tool.needs_approval(call.arguments)
    except Exception:
        log.warning("approval check of %s failed; asking a person", call.name, exc_info=True)
        return True  # when in doubt, ask


async def run_call(tools: Mapping[str, Tool], call: ToolCall, context: ToolContext) -> tuple[str, bool]:
    """The call's result text and whether it is an error (a tool's failure is a result the
    model sees, not a failed turn)."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: there is no tool named {call.name!r}", True
    try:
        value = await tool.invoke(call.arguments, context)
    except asyncio.CancelledError:
        raise
    except msgspec.ValidationError as exc:
        return f"error: invalid arguments for {call.name}: {exc}", True
    except Exception as exc:
        return f"error: {type(exc).__name__}: {exc}", True
    return result_text(value), False


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

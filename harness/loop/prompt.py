"""Prompt assembly (DESIGN.md "Prompt assembly"):

    [tools][system]                       stable bytes, built once per agent     <- breakpoint 0
    [durable history before this turn]    append-only between compactions
    [runtime snapshot, if it changed]     durable: committed with the user message
                                                                                 <- breakpoint k
    [sticky context][this turn's context][this turn's user message]
    [this turn's assistant/tool items so far]
    [runtime snapshot re-read mid-run, if it changed: not persisted]

Page context is inserted here, per model call, and nowhere else: it is never in the items a
step commits, so it can never reach history (I1).

An agent's `input_callback(history, new_input) -> list[Item]` (sync or async) replaces the part
before this turn's outputs: `history` is the active history before the turn, `new_input` this
turn's [snapshot][context][user message]. It gets fresh lists it may change freely. What it
returns is only what the model is shown: what is stored is decided without it (the turn's
snapshot and user message, and the model's outputs, once each), so no reshaping, repeating or
rebuilding of items can store history again (I7). Items it invents are shown to the model on
every call of the turn and never stored.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from harness.errors import CallbackError
from harness.loop.context import context_items
from harness.models.base import ModelRequest, ToolSpec
from harness.types import InboxMessage, Item, ToolCall

InputCallback = Callable[[list[Item], list[Item]], list[Item] | Awaitable[list[Item]]]


def user_item(message: InboxMessage) -> Item:
    """The durable item for a user message; its id is derived from the turn, so it is stable."""
    return Item(
        id=f"it_{message.turn_id}_u",
        role="user",
        text=message.text,
        turn_id=message.turn_id,
        message_id=message.message_id,
    )


def new_input(message: InboxMessage, sticky: dict[str, str], snapshot: Item | None) -> list[Item]:
    """This turn's input, in prompt order: [snapshot][sticky][turn context][user message]."""
    items = [snapshot] if snapshot is not None else []
    items.extend(context_items(message.turn_id, sticky, message.context))
    items.append(user_item(message))
    return items


async def assemble(
    *,
    system: str,
    tools: tuple[ToolSpec, ...],
    callback: InputCallback | None,
    session_id: str,
    turn_id: str,
    step: int,
    history: list[Item],
    fresh: list[Item],
    outputs: Sequence[Item],
    tail: Sequence[Item] = (),
) -> ModelRequest:
    """The request for one model call of a turn: `fresh` is `new_input(...)`, `outputs` the
    turn's committed assistant and tool items, `tail` a mid-run snapshot."""
    if callback is None:
        messages = [*history, *fresh]
    else:
        messages = await _call(callback, [_private(i) for i in history], [_private(i) for i in fresh])
    stable = _stable(messages, history, fresh, callback is not None)
    messages.extend(outputs)
    messages.extend(tail)
    return ModelRequest(
        system=system,
        tools=tools,
        messages=messages,
        session_id=session_id,
        turn_id=turn_id,
        step=step,
        cache_breakpoints=(0, stable) if stable else (0,),
    )


def _private(item: Item) -> Item:
    """The item for the callback to keep or change: Items are frozen, but a tool call's
    arguments are a dict, and the originals are the cached (and committed) history."""
    if not item.tool_calls:
        return item
    calls = tuple(ToolCall(c.name, copy.deepcopy(c.arguments), c.id) for c in item.tool_calls)
    return msgspec.structs.replace(item, tool_calls=calls)


async def _call(callback: InputCallback, history: list[Item], fresh: list[Item]) -> list[Item]:
    try:
        out = callback(history, fresh)
        if inspect.isawaitable(out):
            out = await out
    except Exception as exc:
        raise CallbackError(f"the input callback raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(out, list) or not all(isinstance(i, Item) for i in out):
        raise CallbackError("the input callback must return a list of Items")
    return list(out)


def _stable(messages: list[Item], history: list[Item], fresh: list[Item], reshaped: bool) -> int:
    """How many leading messages the next turn's request repeats unchanged: history and this
    turn's durable input up to its first page context; when a callback reshaped the input, the
    common prefix with history. (Constant time without a callback: history is not walked.)"""
    if not reshaped:
        n = len(history)
        for item in fresh:
            if item.kind in ("context", "sticky"):
                break
            n += 1
        return n
    common = 0
    for item, same in zip(messages, history, strict=False):
        if item is not same and item != same:
            break
        common += 1
    return common

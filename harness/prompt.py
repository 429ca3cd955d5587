"""Prompt assembly (DESIGN.md "Prompt assembly"):

    [tools][system]                       stable bytes, built once per agent
    [durable history before this turn]    append-only
    [sticky context][this turn's context][this turn's user message]
    [this turn's assistant/tool items so far]

Page context is inserted here, per model call, and nowhere else: it is never in the items a
step commits, so it can never reach history (I1).
"""

from __future__ import annotations

from harness.agent import Agent
from harness.context import context_items
from harness.models.base import ModelRequest
from harness.types import InboxMessage, Item


def user_item(message: InboxMessage) -> Item:
    """The durable item for a user message; its id is derived from the turn, so it is stable."""
    return Item(
        id=f"it_{message.turn_id}_u",
        role="user",
        text=message.text,
        turn_id=message.turn_id,
        message_id=message.message_id,
    )


def assemble(
    agent: Agent,
    *,
    session_id: str,
    message: InboxMessage,
    history: list[Item],
    sticky: dict[str, str],
    turn_items: list[Item],
    step: int,
) -> ModelRequest:
    """The request for one model call of a turn. `turn_items` excludes the user item."""
    messages = list(history)
    messages.extend(context_items(message.turn_id, sticky, message.context))
    messages.append(user_item(message))
    messages.extend(turn_items)
    return ModelRequest(
        system=agent.instructions,
        tools=agent.tool_specs,
        messages=messages,
        session_id=session_id,
        turn_id=message.turn_id,
        step=step,
    )

"""Page context (I1): shown to the model, never written to history.

Page context (invariant I1): normalised at the edge of the harness, shown to the model,
never written to history.

A string or list applies to one turn: every model call of that turn sees it, later turns do
not. A mapping is keyed and sticky: each key's newest value is kept beside history (not in it)
and shown every turn until replaced; None removes the key.
"""

from __future__ import annotations

from harness.errors import InvalidInput
from harness.types import Item, PageContext

MAX_ENTRIES = 32
MAX_KEY_LEN = 64


def split_context(context: PageContext) -> tuple[list[str], dict[str, str | None]]:
    """(turn-only entries, keyed updates) from what a caller sent."""
    if context is None:
        return [], {}
    if isinstance(context, str):
        return [context], {}
    if isinstance(context, list):
        if len(context) > MAX_ENTRIES:
            raise InvalidInput(f"context has {len(context)} entries; at most {MAX_ENTRIES} are allowed")
        if not all(isinstance(entry, str) for entry in context):
            raise InvalidInput("context entries must be strings")
        return list(context), {}
    if not isinstance(context, dict):
        raise InvalidInput("context must be a string, a list of strings or an object")
    if len(context) > MAX_ENTRIES:
        raise InvalidInput(f"context has {len(context)} keys; at most {MAX_ENTRIES} are allowed")
    for key, value in context.items():
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN:
            raise InvalidInput(f"context keys must be 1 to {MAX_KEY_LEN} characters")
        if value is not None and not isinstance(value, str):
            raise InvalidInput("context values must be strings, or null to remove a key")
    return [], dict(context)


def context_items(turn_id: str, sticky: dict[str, str], turn_only: list[str]) -> list[Item]:
    """The user-role items that carry page context into one model call, sticky keys first
    (sorted, so the same state renders to the same bytes), then this turn's entries."""
    items = [
        Item(
            id=f"ctx_{turn_id}_k{n}",
            role="user",
            text=f"[page context: {key}]\n{sticky[key]}",
            kind="sticky",
            turn_id=turn_id,
            context_key=key,
        )
        for n, key in enumerate(sorted(sticky))
    ]
    items.extend(
        Item(id=f"ctx_{turn_id}_{n}", role="user", text=f"[page context]\n{text}", kind="context", turn_id=turn_id)
        for n, text in enumerate(turn_only)
    )
    return items

"""Runtime-context snapshots (I6): volatile facts kept out of the cached prefix.

Runtime-context snapshots (I6): volatile facts such as a git branch, the user's plan or
today's date never enter the cached system prompt. Each turn reads the agent's providers once;
the rendered snapshot is appended to history (beside the user message) only when it differs
from the newest snapshot in the active context, so history stays append-only and the prefix
stays cached. After a step that ran tools the providers are read again, and a changed value is
shown at the request tail without writing history (the next user message persists it).
Compaction restores the newest snapshot after its summary.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence

from harness.types import Item

log = logging.getLogger("keel.runtime")
RuntimeFn = Callable[[], str | Awaitable[str | None] | None]
MAX_VALUE = 500  # characters of one provider's value shown to the model
HEADER = "[runtime context; supersedes any earlier runtime context]"
EMPTY = HEADER + "\n(none)"  # what a session with no snapshot yet implicitly shows


class RuntimeContext:
    """The agent's providers, each named by its function name. A provider returns a short
    string, or None for nothing to say. Sync providers run on the event loop: make one that
    does I/O async."""

    def __init__(self, providers: Sequence[RuntimeFn]) -> None:
        self.providers: list[tuple[str, RuntimeFn]] = []
        for fn in providers:
            name = getattr(fn, "__name__", type(fn).__name__)
            if any(name == n for n, _ in self.providers):
                raise ValueError(f"two runtime context providers are named {name!r}")
            self.providers.append((name, fn))

    def __bool__(self) -> bool:
        return bool(self.providers)

    async def read(self) -> str | None:
        """The snapshot text now, or None if a provider failed (then nothing is announced)."""
        lines: list[str] = []
        for name, fn in self.providers:
            try:
                value = fn()
                if inspect.isawaitable(value):
                    value = await value
            except Exception as exc:
                log.warning("runtime context provider %s failed: %s", name, type(exc).__name__)
                return None
            if value is None:
                continue
            if not isinstance(value, str):
                log.warning("runtime context provider %s returned %s, not str", name, type(value).__name__)
                return None
            lines.append(f"{name}: {value[:MAX_VALUE]}")
        return HEADER + "\n" + ("\n".join(lines) if lines else "(none)")


def newest_snapshot(items: Sequence[Item]) -> Item | None:
    for item in reversed(items):
        if item.kind == "runtime":
            return item
    return None


def changed(text: str | None, newest: Item | None) -> bool:
    """Whether a snapshot reading `text` says something the active context does not."""
    return text is not None and text != (newest.text if newest is not None else EMPTY)


def snapshot_item(turn_id: str, text: str, suffix: str) -> Item:
    return Item(id=f"it_{turn_id}_{suffix}", role="user", text=text, kind="runtime", turn_id=turn_id)

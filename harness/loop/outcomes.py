"""What a turn's step comes to, as values the loop matches on, and how a turn announces what it
wrote."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from harness.events import LiveEvent, StoredEvent
from harness.types import Item

# Called after each write: (session id, the events it wrote, whether it settled the turn).
Publish = Callable[[str, list[StoredEvent], bool], None]


class Live(Protocol):
    """Where a turn's transient events go (a reply's text as it streams)."""

    def live(self, sid: str, event: LiveEvent) -> None: ...

    async def flush_live(self) -> None:
        """Return once the live events handed over so far have left for other processes (a
        commit follows: their readers get them before they hear of the commit)."""


@dataclass(frozen=True)
class Final:
    """The turn ended; `more` says whether another message is already waiting."""

    more: bool


@dataclass(frozen=True)
class Paused:
    """The turn waits for answers to approval requests; the lease is released."""


@dataclass(frozen=True)
class RunTools:
    item: Item  # the committed assistant item whose calls must now run
    announced: str | None = None  # the call whose tool.started is already written (it runs next)


@dataclass(frozen=True)
class Cancel:
    """A cancel was asked for this turn: end it now."""


Outcome = Final | Paused
StepOutcome = Final | Paused | RunTools | Cancel

"""What a turn's step comes to, as values the loop matches on."""

from __future__ import annotations

from dataclasses import dataclass

from harness.types import Item


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
class EndCancelled:
    """A cancel was asked for this turn: end it now."""


Outcome = Final | Paused
StepOutcome = Final | Paused | RunTools | EndCancelled

"""A session in a runner's hands: one explicit state, a small state machine.

A session in a runner's hands: one explicit state, from the moment the runner takes the
session (a job for it, a message this process accepted, a submit that may begin its turn) until
its inbox is drained, its lease is lost, or it is handed over.

    RESERVED ──────────────────────────────────┐   a submit holds it (its SUBMIT may begin the turn)
       │ SUBMIT began nothing: dropped         │ SUBMIT began the turn
    QUEUED ──▶ DRAINING ◀─────▶ RUNNING ◀──────┘   QUEUED: its drain waits for a runner slot
                 ▲   │             │               DRAINING: between turns (BEGIN, acks)
                 │   ▼             ▼               RUNNING: holds the lease, runs a turn
               WAITING           ENDED             WAITING: another runner holds the lease
                                                   ENDED: let go as its turn ended (below)

A turn whose final commit left the inbox empty, with no work come for the session since its
drain began, ends the drain there: the session is let go at once (ENDED: its jobs acknowledged,
its slot free, out of the runner's hands) while its task is still unwinding, so that a message
sent as the turn's answer arrives is taken as one that finds the session idle here.

Besides its phase it keeps what the drain needs: the jobs read for it (acknowledged when the
drain ends), the newest job it was kicked with, the newest job the running drain began after
(`mark`: jobs up to it are seen), whether work came after the drain began (`again`), the lease's
fencing token while RUNNING, and the event that ends a WAITING early.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from harness.store import JobId


class Phase(enum.Enum):
    RESERVED = "reserved"
    QUEUED = "queued"
    DRAINING = "draining"
    WAITING = "waiting"
    RUNNING = "running"
    ENDED = "ended"


# the moves the machine has, (from, to) (a tuple, not a dict: an Enum member hashes in Python)
_MOVES = (
    (Phase.RESERVED, Phase.RUNNING),
    (Phase.QUEUED, Phase.DRAINING),
    (Phase.DRAINING, Phase.RUNNING),
    (Phase.DRAINING, Phase.WAITING),
    (Phase.WAITING, Phase.DRAINING),
    (Phase.RUNNING, Phase.DRAINING),
    (Phase.RUNNING, Phase.ENDED),
)


@dataclass
class InHand:
    """One session a runner has in hand, and where it is."""

    phase: Phase
    jobs: list[JobId] = field(default_factory=list)  # read for it: acknowledged when its drain ends
    kicked: JobId | None = None  # the newest job handed over locally, not drained yet
    mark: JobId | None = None  # the newest job the running drain began after (those up to it are seen)
    again: bool = False  # work came after the drain began: it goes round once more
    fence: str = ""  # RUNNING: the lease's fencing token
    wake: asyncio.Event | None = None  # WAITING: set to end the wait early

    def to(self, phase: Phase) -> None:
        """Move to `phase`; a move the machine does not have is a bug."""
        if (self.phase, phase) not in _MOVES:
            raise AssertionError(f"a session in hand cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase
        if phase is not Phase.RUNNING:
            self.fence = ""
        if phase is not Phase.WAITING:
            self.wake = None

    def kick(self, job: JobId) -> None:
        """A job this process added: the next round of the drain covers it."""
        if self.kicked is None or job > self.kicked:
            self.kicked = job

    def got(self, job: JobId) -> None:
        """A job for the session read from the stream while it is in hand."""
        self.jobs.append(job)
        if self.wake is not None:  # (another runner's drain gave the session back, maybe)
            self.wake.set()
        if self.mark is None or not job.seen_by(self.mark):
            self.again = True

    def round(self) -> JobId | None:
        """A new round of the drain begins: the newest job it covers (its mark), if any."""
        self.again = False
        newest = max([*self.jobs, *([self.kicked] if self.kicked is not None else [])], default=None)
        self.kicked = None
        if newest is not None:
            self.mark = newest
        return newest

    def covers(self, job: JobId) -> bool:
        """Whether the running drain began after `job` was added (so it sees its work)."""
        return self.mark is not None and job.seen_by(self.mark)

"""What the store's commands hand back.

What the store's commands hand back: decoded values, and tagged unions where a command has
several outcomes (the callers `match` on them). The scripts' own replies are in `protocol`."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from harness.events import StoredEvent
from harness.store.queue import JobId
from harness.types import Answer, InboxMessage, Item, SessionStatus, Usage

# ---- a session -----------------------------------------------------------------------------


class SessionMeta(msgspec.Struct, frozen=True):
    """A session's meta hash, as the reads need it."""

    owner: str
    status: SessionStatus
    created_at: float
    metadata: dict[str, Any]  # as the session was created with it
    turn: str = ""  # the turn in progress (running or paused), "" between turns
    waiting_on: tuple[str, ...] = ()  # the paused turn's request ids, in the order they were made
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    model_calls: int = 0
    title: str | None = None  # set, or the start of its first message (None before one)
    updated_at: float = 0.0  # its latest activity: a message, a turn's end or pause


class Submitted(msgspec.Struct, frozen=True):
    """What `Store.submit` did. A repeated message_id gives the first one's ids (and no event)."""

    duplicate: bool
    turn_id: str
    received_id: str
    job: JobId  # the job queued with it
    received: StoredEvent | None = None  # its message.received, when new
    began: Begun | None = None  # the turn SUBMIT began, if it did
    created: StoredEvent | None = None  # its session's session.created, when this message made it
    steered: bool = False  # it joined the running turn (`turn_id`; `received`: its message.steered)
    interrupted: str | None = None  # the turn it asked to end (policy "interrupt")


class Recorded(msgspec.Struct, frozen=True):
    """An answer was recorded: `runnable` when it was the last open request of the paused turn."""

    answer: Answer
    event: StoredEvent  # its input.resolved
    runnable: bool = False
    job: JobId | None = None  # the session's job, when one was queued with the answer


class AlreadyAnswered(msgspec.Struct, frozen=True):
    """The request has an answer already: `answer` is the one recorded first."""

    answer: Answer
    job: JobId | None = None


Responded = Recorded | AlreadyAnswered


class Cancelling(msgspec.Struct, frozen=True):
    """A cancel of `turn_id` is recorded; the runner holding (or next taking) it ends it."""

    turn_id: str
    job: JobId | None = None  # the session's job, when one was queued with the cancel


class NothingToCancel(msgspec.Struct, frozen=True):
    pass


CancelAsked = Cancelling | NothingToCancel


# ---- a turn ----------------------------------------------------------------------------------


class Begun(msgspec.Struct, frozen=True):
    """What BEGIN hands a runner: its fencing token and the state of the turn to run."""

    fence: str
    message: InboxMessage
    history: list[Item]  # active history before this turn
    turn_items: list[Item]  # what this turn already committed (non-empty only on resume)
    sticky: dict[str, str]
    started_id: str = ""  # the turn.started event this BEGIN wrote ("" when resuming a turn)
    cancel: bool = False  # a cancel was asked for this turn
    answers: dict[str, Answer | None] = {}  # the paused step's requests and their answers so far
    last_in: int = 0  # provider-reported input tokens of the session's last turn call (0: none)
    last_est: int = 0  # keel's estimate of that same request
    took_over: bool = False  # resumed from a runner whose lease lapsed (a crash, a stall)
    announced: str = ""  # the call of the paused step whose tool.started was written (it ran, or runs, next)


class Busy(msgspec.Struct, frozen=True):
    """Another runner holds the session's lease; it lapses in `retry_ms` if that runner died."""

    retry_ms: int


class NoWork(msgspec.Struct, frozen=True):
    """Nothing to begin: the inbox is empty, the turn waits for answers, or no such session."""


BeginOutcome = Begun | Busy | NoWork


class UsageRecord(msgspec.Struct, frozen=True):
    """A provider attempt's tokens, written by its step's COMMIT script before the fence is
    checked, so a refused or retried step still shows every attempt (I5)."""

    step: int
    usage: Usage
    estimate: int | None = None  # keel's estimate of the request (when compaction needs it)


CommitMode = Literal["step", "final", "pause"]


class Stepped(msgspec.Struct, frozen=True):
    """The step is committed: the turn goes on."""

    events: list[StoredEvent]  # what the commit wrote to the outbox, in order
    steered: list[Item] = []  # messages steered into the turn that joined it with this commit


class CancelPending(msgspec.Struct, frozen=True):
    """The step is committed, and a cancel was asked for the turn: end it now (a pause commit
    did not pause)."""

    events: list[StoredEvent]


class Withheld(msgspec.Struct, frozen=True):
    """A guarded commit found a cancel pending: nothing was written but the usage."""

    events: list[StoredEvent]


class AwaitingAnswers(msgspec.Struct, frozen=True):
    """The turn pauses for its approval requests; the lease is released."""

    events: list[StoredEvent]


class Ended(msgspec.Struct, frozen=True):
    """The turn ended; `more`: another message waits (the lease is kept for it)."""

    events: list[StoredEvent]
    more: bool


Commit = Stepped | CancelPending | Withheld | AwaitingAnswers | Ended

"""What the store's commands hand back: plain values, decoded (the scripts' own replies are in
`protocol`)."""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from harness.events import StoredEvent
from harness.types import Answer, InboxMessage, Item, Usage


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
    started: StoredEvent | None = None  # the event `started_id` names
    took_over: bool = False  # resumed from a runner whose lease lapsed (a crash, a stall)


class Submitted(NamedTuple):
    """What Store.submit did: a repeated message_id gives the first one's ids (and no event)."""

    duplicate: bool
    turn_id: str
    received_id: str
    received: StoredEvent | None  # its message.received, when new
    began: Begun | None  # the turn SUBMIT began, if it did
    job_id: str  # the job queued with it
    created: StoredEvent | None = None  # its session's session.created, when this message made it


class Busy(msgspec.Struct, frozen=True):
    retry_ms: int


class UsageRecord(msgspec.Struct, frozen=True):
    """A provider attempt's tokens, written by its step's COMMIT script before the fence is
    checked, so a refused or retried step still shows every attempt (I5)."""

    step: int
    usage: Usage
    estimate: int | None = None  # keel's estimate of the request (when compaction needs it)


class Committed(msgspec.Struct, frozen=True):
    events: list[StoredEvent]  # what the commit wrote to the outbox, in order
    more: bool = False  # final commit only: the inbox has another message, lease kept
    paused: bool = False  # pause commit: the session now waits for answers, lease released
    cancel: bool = False  # a cancel was asked for this turn: finish it as cancelled
    dropped: bool = False  # a guarded commit found that cancel: it wrote nothing but the usage


class Responded(msgspec.Struct, frozen=True):
    """RESPOND's outcome: `answer` is the recorded one (the earlier one if already answered)."""

    recorded: bool
    answer: Answer
    runnable: bool = False  # this was the last open request of the paused turn
    event: StoredEvent | None = None  # its input.resolved, when recorded
    job_id: str | None = None  # the session's job, when one was queued with the answer

"""Wire and storage types of the harness: msgspec Structs, encoded once, stored encoded.

Schema evolution: a persisted struct may gain fields (always with a default); a field's type
never changes. Everything here is plain data; behaviour lives in the modules that use it.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Protocol

import msgspec

from harness.events import Decision, Requested, StoredEvent, TurnStatus

Role = Literal["user", "assistant", "tool"]
# "message": a user message or a model reply; "tool_result": a tool's answer;
# "context": page context (never stored); "sticky": keyed page context (stored beside history);
# "runtime": a runtime-context snapshot; "summary": compaction's summary of earlier turns;
# "todo": the todo list, re-injected after a summary.
ItemKind = Literal["message", "tool_result", "context", "sticky", "runtime", "summary", "todo"]
# What an inbox entry asks for: a user message's turn, or a manual compaction or clear.
EntryKind = Literal["message", "compact", "clear"]
SessionStatus = Literal["idle", "running", "waiting"]
# What a message sent while a turn runs or waits does: wait its turn, join the running turn,
# end it and run next, or be refused.
MessagePolicy = Literal["queue", "steer", "interrupt", "reject"]


class ToolCall(msgspec.Struct, frozen=True, omit_defaults=True):
    """A model's request to run one tool. `id` is assigned by the harness when the model gives none."""

    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    id: str | None = None


class Usage(msgspec.Struct, frozen=True):
    """One provider attempt's tokens. `input_tokens` counts the whole prompt; of it,
    `cached_tokens` were read from the provider's prompt cache and `cache_write_tokens` written
    to it."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class Item(msgspec.Struct, frozen=True, omit_defaults=True):
    """One entry of a conversation as the model sees it; durable history is a list of these."""

    id: str
    role: Role
    text: str = ""
    kind: ItemKind = "message"
    turn_id: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    tool_name: str | None = None
    is_error: bool = False
    message_id: str | None = None
    context_key: str | None = None
    # What a provider needs back unchanged in the tool loop and no one is shown (Anthropic's
    # thinking blocks with their signatures, OpenAI's reasoning items), under the provider's
    # name: another provider ignores it.
    provider: dict[str, Any] | None = None


# Page context as a channel hands it to the harness: a string, a list of strings (this turn
# only), or a mapping (keyed, sticky; None removes the key).
PageContext = str | list[str] | dict[str, str | None] | None


class InboxMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    """A user message waiting for (or in) its turn, or a compact/clear queued behind the turns
    before it (`kind`; no text, no user item). Lives in the session inbox, not in history.
    (Entries written before 2026-12 also carry a `received_id`, ignored: the `mids` hash has it.)"""

    message_id: str
    turn_id: str
    text: str = ""
    kind: EntryKind = "message"
    context: list[str] = []  # this turn only
    sticky: dict[str, str | None] = {}  # keyed updates, applied when the turn begins
    author: str = ""  # who wrote it, as the channel names them (a Slack user id); "" over the API
    trace: str = ""  # the W3C traceparent of the request that sent it (tracing on): its turn's parent


class SessionInfo(msgspec.Struct, frozen=True):
    session_id: str
    status: SessionStatus
    pending: list[Requested]
    queued: int
    usage: dict[str, int]
    metadata: dict[str, Any]
    created_at: float
    title: str | None = None  # set (PATCH), or the start of its first message; None before one
    updated_at: float = 0.0  # its latest activity: a message, a turn's end or pause


SESSIONS_PAGE_MAX = 100  # sessions a page of the list holds at most


class ListedSession(msgspec.Struct, frozen=True):
    """One session as its owner's list shows it."""

    session_id: str
    title: str | None  # set (PATCH), or the start of its first message; None before one
    status: SessionStatus
    metadata: dict[str, Any]
    created_at: float
    updated_at: float  # its latest activity: a message, a turn's end or pause
    preview: str  # the start of its last message (the user's or the agent's)


class SessionPage(msgspec.Struct, frozen=True):
    """A page of an owner's sessions, most recent activity first; `next_cursor` asks for the
    next one (None after the last)."""

    items: list[ListedSession]
    next_cursor: str | None


class Armed(Protocol):
    """A reader's subscription to a session's events, opened before what it will read (so it
    misses no live event meanwhile): opaque, handed back to `Sessions.tail` and `disarm`."""


class TurnAt(msgspec.Struct, frozen=True):
    """A turn in progress (running, paused or queued next) and where a replay of it starts:
    `after` is just before its first event (its message.received)."""

    turn_id: str
    after: str
    message_id: str
    waiting: bool  # paused for answers


class SubmitResult(msgspec.Struct, frozen=True):
    session_id: str
    message_id: str
    turn_id: str
    received_id: str
    duplicate: bool
    received_seq: int = 0  # the seq of its message.received (0 for a duplicate)
    # what became of it: it waits its turn (or starts one), joined the running turn (`turn_id`,
    # `received_id` its message.steered), or runs next while the turn in progress is cancelled
    handled: Literal["queued", "steered", "interrupting"] = "queued"


class TurnOutcome(msgspec.Struct, frozen=True):
    """How a turn came out (`pending`: not yet, when the wait ended), with the events of it that
    were waited for."""

    status: TurnStatus | Literal["pending"]
    reply: str | None
    events: list[StoredEvent]


class TurnResult(msgspec.Struct, frozen=True):
    """How a message's turn came out (`pending`: not yet, when the wait ended), with its events
    from its message.received on."""

    session_id: str
    message_id: str
    status: TurnStatus | Literal["pending"]
    reply: str | None
    events: list[StoredEvent]


item_encoder = msgspec.json.Encoder()
item_decoder = msgspec.json.Decoder(Item)
inbox_decoder = msgspec.json.Decoder(InboxMessage)


class ApprovalRequest(msgspec.Struct, frozen=True):
    """A tool call waiting for a person's answer. Stored once, never rewritten."""

    request_id: str
    call_id: str
    tool: str
    arguments: dict[str, Any]
    turn_id: str


class Answer(msgspec.Struct, frozen=True, omit_defaults=True):
    decision: Decision
    reason: str = ""
    by: str = ""  # who answered, as the channel names them (a Slack user id); "" over the API


request_decoder = msgspec.json.Decoder(ApprovalRequest)
answer_decoder = msgspec.json.Decoder(Answer)


class Depth(NamedTuple):
    """The turn job queue now: jobs not yet done (unread, or read and not acknowledged), and the
    age of the oldest of them in seconds (0 with none)."""

    jobs: int
    oldest_s: float


class Subscription(msgspec.Struct, frozen=True):
    """An API key's outbound event webhook: a URL, the event types it wants, the secret its
    deliveries are signed with."""

    id: str
    owner: str
    url: str
    events: list[str]
    secret: str
    description: str = ""
    created_at: float = 0.0
    disabled: str = ""  # why deliveries stopped (the receiver answered 410), "" while active

    @property
    def destination(self) -> str:
        """Its delivery relay destination."""
        return f"wh:{self.id}"


class DeadLetter(msgspec.Struct, frozen=True):
    """An event the delivery relay gave up on for one destination, and why."""

    session_id: str
    event_id: str
    destination: str
    error: str
    attempts: int
    at: float
    # (>0: how many events after `event_id` left the outbox before the relay read them, by
    # KEEL_EVENT_RETENTION_HOURS or _RETENTION, from seq `lost_from` on: nothing to deliver again)
    lost: int = 0
    lost_from: int = 0
    # (its event left the outbox before a retry could deliver it again: nothing to deliver)
    gone: bool = False

    @property
    def field(self) -> str:
        """Its field in the destination's dead letters (a loss: by its first seq, one of its own)."""
        return f"{self.session_id} lost {self.lost_from}" if self.lost else f"{self.session_id} {self.event_id}"

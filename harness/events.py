"""The catalogue of keel's events: each type's data shape, one tagged union on `type`.

The catalogue of keel's events: every event type keel emits, each a msgspec Struct with the
shape of its `data`, in one tagged union on `type`. The harness builds events from it (`pending`,
`delta`, `session_deleted`; the store's scripts take their type names from it too) and every
reader decodes with it (`decode`, `StoredEvent.decoded`). No other module spells a type's name.

On the wire an event is one envelope, `{"id", "seq", "type", "session_id", "turn_id", "at",
"data"}`: `id` is the outbox stream id, `seq` a per-session counter. A committed event is stored
in the session's outbox stream as fields `s` (seq), `t` (type) and `b` (its body: the envelope's
JSON after `session_id`, `"turn_id":...,"at":...,"data":...}`); a reader puts `id`, `seq`, `type`
and `session_id` in front, so every delivery of an event, read back or handed over by the process
that wrote it, is the same bytes (`StoredEvent.raw`). A live event (`message.delta`,
`session.deleted`) has no `id` or `seq` and is never stored (`LiveEvent`).

    committed                 data
    session.created           metadata
    message.received          message_id, text
    turn.started              message_id                       (written by BEGIN)
    message.completed         item_id, text
    tool.started              call_id, tool, arguments
    tool.completed            call_id, tool, result, is_error
    input.requested           requests [{request_id, tool, arguments}], author?
    input.resolved            request_id, decision, reason, by?
    usage.recorded            step, input_tokens, output_tokens, cached_tokens,
                              cache_write_tokens, failed?, purpose?
    compaction.requested      reason, tokens?, context_window?
    compaction.completed      reason, tokens_before?, trimmed?, summarized?, tokens_after?,
                              tokens_saved?, error?
    context.cleared           items
    turn.completed            message_id, reply
    turn.failed               message_id, error {code, message}
    turn.cancelled            message_id
    session.waiting           (nothing)
    live
    message.delta             item_id, delta, offset
    session.deleted           reason ("deleted" | "gone")

(A `?` field is left out when it has its default. Events written before a field existed decode
with its default: a `data` shape only ever gains fields that have one.)
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar, cast

import msgspec

TurnStatus = Literal["completed", "failed", "cancelled", "waiting"]
Decision = Literal["approve", "deny", "withdrawn"]  # an answer to an approval request
_enc = msgspec.json.Encoder()


# ---- what each event says: its data -----------------------------------------------------------


class ErrorInfo(msgspec.Struct, frozen=True):
    code: str
    message: str


class Data(msgspec.Struct, frozen=True, omit_defaults=True):
    """The `data` of an event. Fields without a default are always written, in this order."""


class SessionCreatedData(Data, frozen=True):
    metadata: dict[str, Any]


class MessageReceivedData(Data, frozen=True):
    message_id: str
    text: str


class MessageSteeredData(Data, frozen=True):
    """A message sent with `policy: "steer"` while a turn ran: it joins that turn (the
    envelope's `turn_id`) before its next model call, or, if the turn ends first, runs as the
    next turn (a `message.received` of its own then)."""

    message_id: str
    text: str


class TurnStartedData(Data, frozen=True):
    message_id: str


class MessageCompletedData(Data, frozen=True):
    item_id: str
    text: str


class ToolStartedData(Data, frozen=True):
    call_id: str
    tool: str
    arguments: dict[str, Any]


class ToolCompletedData(Data, frozen=True):
    call_id: str
    tool: str
    result: str
    is_error: bool


class Requested(msgspec.Struct, frozen=True):
    """One approval request, as `input.requested` shows it."""

    request_id: str
    tool: str
    arguments: dict[str, Any]


class InputRequestedData(Data, frozen=True):
    requests: list[Requested]
    author: str = ""  # who may be asked, for a channel that lets only them answer


class InputResolvedData(Data, frozen=True):
    request_id: str
    decision: Decision
    reason: str
    by: str = ""  # who answered, as the channel names them ("" over the API)


class UsageRecordedData(Data, frozen=True):
    step: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    failed: bool = False  # the attempt failed (it may still be billed)
    purpose: str = "turn"  # or "compaction": a summary's call


class CompactionRequestedData(Data, frozen=True):
    reason: str  # "threshold", "context_length" (the provider said the prompt is too long), "manual"
    tokens: int | None = None
    context_window: int | None = None


class CompactionCompletedData(Data, frozen=True):
    reason: str
    tokens_before: int | None = None
    trimmed: int | None = None
    summarized: int | None = None
    tokens_after: int | None = None
    tokens_saved: int | None = None
    error: ErrorInfo | None = None


class ContextClearedData(Data, frozen=True):
    items: int


class TurnCompletedData(Data, frozen=True):
    message_id: str
    reply: str


class TurnFailedData(Data, frozen=True):
    message_id: str
    error: ErrorInfo


class TurnCancelledData(Data, frozen=True):
    message_id: str


class SessionWaitingData(Data, frozen=True):
    pass


class MessageDeltaData(Data, frozen=True):
    item_id: str
    delta: str
    offset: int  # where `delta` starts in the item's text, in characters


class SessionDeletedData(Data, frozen=True):
    reason: Literal["deleted", "gone"]  # deleted: by DELETE; gone: found no longer there (expired, say)


# ---- the envelopes: one per type, a tagged union on `type` ------------------------------------


class Envelope(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """What every event carries besides its data. `TYPE` is the event's type name."""

    TYPE: ClassVar[str]
    session_id: str
    turn_id: str | None
    at: float


class Committed(Envelope, frozen=True):
    """An event in the session's outbox: `id` its stream id, `seq` its place in the session.
    `OUTCOME`: how a turn whose newest event this is came out (None: it has not settled)."""

    OUTCOME: ClassVar[TurnStatus | None] = None
    id: str
    seq: int


class SessionCreated(Committed, frozen=True, tag="session.created"):
    data: SessionCreatedData


class MessageReceived(Committed, frozen=True, tag="message.received"):
    data: MessageReceivedData


class MessageSteered(Committed, frozen=True, tag="message.steered"):
    data: MessageSteeredData


class TurnStarted(Committed, frozen=True, tag="turn.started"):
    data: TurnStartedData


class MessageCompleted(Committed, frozen=True, tag="message.completed"):
    data: MessageCompletedData


class ToolStarted(Committed, frozen=True, tag="tool.started"):
    data: ToolStartedData


class ToolCompleted(Committed, frozen=True, tag="tool.completed"):
    data: ToolCompletedData


class InputRequested(Committed, frozen=True, tag="input.requested"):
    OUTCOME = "waiting"
    data: InputRequestedData


class InputResolved(Committed, frozen=True, tag="input.resolved"):
    data: InputResolvedData


class UsageRecorded(Committed, frozen=True, tag="usage.recorded"):
    data: UsageRecordedData


class CompactionRequested(Committed, frozen=True, tag="compaction.requested"):
    data: CompactionRequestedData


class CompactionCompleted(Committed, frozen=True, tag="compaction.completed"):
    data: CompactionCompletedData


class ContextCleared(Committed, frozen=True, tag="context.cleared"):
    data: ContextClearedData


class TurnCompleted(Committed, frozen=True, tag="turn.completed"):
    OUTCOME = "completed"
    data: TurnCompletedData


class TurnFailed(Committed, frozen=True, tag="turn.failed"):
    OUTCOME = "failed"
    data: TurnFailedData


class TurnCancelled(Committed, frozen=True, tag="turn.cancelled"):
    OUTCOME = "cancelled"
    data: TurnCancelledData


class SessionWaiting(Committed, frozen=True, tag="session.waiting"):
    """A manual compact or clear is done: the session waits for its next message."""

    data: SessionWaitingData


class Transient(Envelope, frozen=True):
    """A live event: handed to the readers connected now, in every process; never stored."""


class MessageDelta(Transient, frozen=True, tag="message.delta"):
    """A piece of a reply as it streams (may be coalesced); `message.completed` is the truth."""

    data: MessageDeltaData


class SessionDeleted(Transient, frozen=True, tag="session.deleted"):
    """The last thing a reader of a session gets when the session ends (on SSE without `id:`,
    on the websocket as a frame before the close)."""

    turn_id: None
    data: SessionDeletedData


Event = (
    SessionCreated
    | MessageReceived
    | MessageSteered
    | TurnStarted
    | MessageCompleted
    | ToolStarted
    | ToolCompleted
    | InputRequested
    | InputResolved
    | UsageRecorded
    | CompactionRequested
    | CompactionCompleted
    | ContextCleared
    | TurnCompleted
    | TurnFailed
    | TurnCancelled
    | SessionWaiting
)
Live = MessageDelta | SessionDeleted
COMMITTED: tuple[type[Committed], ...] = Event.__args__
LIVE: tuple[type[Transient], ...] = Live.__args__
_DATA: dict[type[Data], str] = {}
for _cls in (*COMMITTED, *LIVE):
    _cls.TYPE = str(_cls.__struct_config__.tag)
    _DATA[next(f.type for f in msgspec.structs.fields(_cls) if f.name == "data")] = _cls.TYPE

TYPES = frozenset(c.TYPE for c in COMMITTED)  # every committed type (what a webhook may subscribe to)
OUTCOMES: dict[str, TurnStatus] = {c.TYPE: c.OUTCOME for c in COMMITTED if c.OUTCOME is not None}
# after one of these a session may have nothing more to say for now (a turn settled, or a manual
# compact or clear is over)
SETTLING = frozenset({*OUTCOMES, CompactionCompleted.TYPE, ContextCleared.TYPE})

_decode_event = msgspec.json.Decoder(Event).decode
_decode_live = msgspec.json.Decoder(Live).decode
E = TypeVar("E", bound=Committed)


def decode(raw: bytes) -> Event:
    """A committed event's envelope, typed (raises msgspec.DecodeError / ValidationError)."""
    return _decode_event(raw)


# ---- building events --------------------------------------------------------------------------


class Pending(NamedTuple):
    """An event a commit is to write: its type and its stored body."""

    type: str
    body: bytes


def body(turn_id: str | None, data: Data, at: float | None = None) -> bytes:
    """The stored tail of an envelope: `"turn_id":...,"at":...,"data":...}`."""
    at = time.time() if at is None else at
    tid = b"null" if turn_id is None else _enc.encode(turn_id)
    return b'"turn_id":' + tid + b',"at":' + _enc.encode(round(at, 6)) + b',"data":' + _enc.encode(data) + b"}"


def pending(turn_id: str | None, data: Data, at: float | None = None) -> Pending:
    """The event whose data is `data` (its type follows from the data's shape)."""
    return Pending(_DATA[type(data)], body(turn_id, data, at))


# ---- committed events as bytes ----------------------------------------------------------------


class StoredEvent(NamedTuple):
    """A committed event: in the session's outbox stream under `id`, replayed on resume."""

    id: str
    type: str
    raw: bytes  # the envelope as JSON, byte-identical on every delivery
    seq: int  # the per-session counter: consecutive, so a gap shows

    def decoded(self) -> Event:
        """The envelope, typed."""
        return _decode_event(self.raw)

    def of(self, kind: builtins.type[E]) -> E | None:
        """The envelope, typed, if it is a `kind` event (decoded only then)."""
        if self.type != kind.TYPE:
            return None
        event = _decode_event(self.raw)
        return cast(E, event) if isinstance(event, kind) else None


def made(sid: str, eid: str, seq: int, etype: str, stored: bytes) -> StoredEvent:
    """An event as its commit wrote it: the same bytes a read of the outbox gives."""
    head = b'{"id":"%s","seq":%d,"type":"%s","session_id":' % (eid.encode(), seq, etype.encode())
    return StoredEvent(eid, etype, head + _enc.encode(sid) + b"," + stored, seq)


def envelope(sid: str, eid: bytes, fields: dict[bytes, bytes]) -> StoredEvent:
    """An event as read back from the outbox stream."""
    return made(sid, eid.decode(), int(fields[b"s"]), fields[b"t"].decode(), fields[b"b"])


def written(sid: str, ids: Sequence[str], first_seq: int, events: Sequence[Pending]) -> list[StoredEvent]:
    """The events a script emitted, in order (their seqs are consecutive from `first_seq`)."""
    return [made(sid, eid, first_seq + n, e.type, e.body) for n, (eid, e) in enumerate(zip(ids, events, strict=True))]


# ---- live events ------------------------------------------------------------------------------


class LiveEvent(NamedTuple):
    """A transient event as bytes: handed to the readers connected now, in every process, never
    stored or replayed; it has no id and no seq. `item_id`: the item it is part of ("" if none)."""

    type: str
    raw: bytes
    item_id: str

    def decoded(self) -> Live:
        return _decode_live(self.raw)


def _live(sid: str, turn_id: str | None, data: Data) -> bytes:
    head = b'{"type":"%s","session_id":' % _DATA[type(data)].encode()
    return head + _enc.encode(sid) + b"," + body(turn_id, data)


def delta(sid: str, turn_id: str, item_id: str, text: str, offset: int) -> LiveEvent:
    """A piece of a reply's text: `offset` is where it starts in the item's text (characters)."""
    return LiveEvent(MessageDelta.TYPE, _live(sid, turn_id, MessageDeltaData(item_id, text, offset)), item_id)


def session_deleted(sid: str, reason: Literal["deleted", "gone"]) -> LiveEvent:
    """The last thing a reader of a session gets when the session ends: `reason` "deleted" (a
    DELETE, told to every process) or "gone" (the reader found it no longer there: deleted while
    the notice was lost, or expired)."""
    return LiveEvent(SessionDeleted.TYPE, _live(sid, None, SessionDeletedData(reason)), "")


def live_event(raw: bytes) -> LiveEvent:
    """A live event as another process sent it (its envelope, as `delta` made it)."""
    event = _decode_live(raw)
    return LiveEvent(event.TYPE, raw, event.data.item_id if isinstance(event, MessageDelta) else "")

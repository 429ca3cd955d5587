"""The scripts' protocol, named and typed: what each Lua script takes and what it answers.

A script gets its keys by name and one argument, its `...Args` Struct packed as MessagePack:
the Lua prelude that `Script` puts in front of each script makes them `K.<name>` and
`A.<field>`. A script names the events it writes as `EV.<Event>` (`EV.TurnStarted`),
which `Script` replaces with the type's name from the catalogue (`harness.events`). It
answers one MessagePack map, decoded here into its reply Struct (a tagged union where a
script has several outcomes). Nothing outside this module indexes a reply or lays out an
argument list, and no JSON is cut or spliced: stored JSON (history items, inbox entries,
event bodies) travels as strings and is written byte for byte. Redis's Lua MessagePack has no
`bin` type, so those strings are text (UTF-8 JSON, as msgspec writes it).

The delivery relay's scripts are in `protocol_relay`, the rate limiter's in `quotas`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec

from harness import events
from harness.store import lua, lua_turn
from harness.store.keys import DeliveryKeys, QuotaKeys, RelayKeys, SessionKeys
from harness.store.types import CommitMode
from harness.types import MessagePolicy

R_co = TypeVar("R_co", covariant=True)
_pack = msgspec.msgpack.Encoder().encode
_EVENT_TYPE = re.compile(r"\bEV\.([A-Z][A-Za-z]+)\b")
KEYS_MEMO = 4096  # sessions whose keys a script keeps made (past that, it starts again)


def _event_types(body: str) -> str:
    """The script with `EV.<Event>` replaced by that event's type name, from the catalogue."""
    return _EVENT_TYPE.sub(lambda m: "'" + getattr(events, m.group(1)).TYPE + "'", body)


class Script(Generic[R_co]):
    """One script: its source with the prelude that names its keys and arguments, its SHA1,
    and the decoder of its reply."""

    def __init__(self, body: str, keys: Sequence[str], reply: Any) -> None:
        # (`reply`: the reply's type, a Struct or a union of them: the constants below say which)
        names = ", ".join(f"{name} = KEYS[{n}]" for n, name in enumerate(keys, start=1))
        self.source = f"local K = {{{names}}}\nlocal A = cmsgpack.unpack(ARGV[1])\n{_event_types(body)}"
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()
        self.key_names = tuple(keys)
        self._decode = msgspec.msgpack.Decoder(reply).decode
        self._of: dict[str, tuple[str, ...]] = {}  # session id -> its keys, as this script names them

    def keys(self, k: SessionKeys | DeliveryKeys | RelayKeys | QuotaKeys) -> list[str]:
        return [getattr(k, name) for name in self.key_names]

    def session_keys(self, sid: str) -> tuple[str, ...]:
        """`keys` of session `sid` (made once for the sessions used lately)."""
        found = self._of.get(sid)
        if found is None:
            if len(self._of) >= KEYS_MEMO:
                self._of.clear()
            found = self._of[sid] = tuple(self.keys(SessionKeys(sid)))
        return found

    @staticmethod
    def args(args: msgspec.Struct) -> list[bytes]:
        return [_pack(args)]

    def reply(self, raw: bytes) -> R_co:
        decoded: R_co = self._decode(raw)
        return decoded


class Reply(msgspec.Struct, tag_field="tag"):
    """Base of the replies that say which outcome they are."""


class Missing(Reply, tag="missing"):
    """No such session, or not the caller's (the two look the same)."""


class Added(Reply, tag="ok"):
    """An event was written: its stream id and seq."""

    id: str
    seq: int


class Done(Reply, tag="ok"):
    pass


# ---- CREATE ------------------------------------------------------------------------------


class CreateArgs(msgspec.Struct, frozen=True):
    owner: str
    created_at: str
    metadata: str  # JSON
    retention: int
    body: str  # the session.created event body
    ttl_ms: int = 0  # every key of the session expires this long after its last activity (0: never)


class Exists(Reply, tag="exists"):
    pass


# ---- BEGIN (and SUBMIT's begin) ----------------------------------------------------------


class BeginArgs(msgspec.Struct, frozen=True):
    fence: str  # this runner's current token, or ""
    lease_ms: int
    now: str  # the events' `at`
    retention: int
    have_start: int  # the caller's cached history: where it starts (-1: none) ...
    have_len: int  # ... and how many items it holds
    have_epoch: str = ""  # ... of which incarnation of the session (its meta's created_at)


class Began(Reply, tag="ok"):
    fence: int
    head: str  # the inbox entry of the turn (JSON)
    n_before: int  # active history items before this turn's
    start: int  # where the active history starts in the list
    reused: int  # how many of the caller's cached items are still good
    items: list[str] = []  # the active history from `reused` on
    sticky: list[tuple[str, str]] = []  # (key, text), as HGETALL gives them
    started_id: str = ""  # the turn.started (or compaction.requested) this BEGIN wrote
    started_seq: int = 0
    started_body: str = ""
    cancel: bool = False
    decisions: list[tuple[str, str]] = []  # the paused step's requests in order, their answers ("" = none)
    last_in: int = 0
    last_est: int = 0
    took_over: bool = False  # the turn was in progress under a lease that lapsed
    epoch: str = ""  # the session's created_at (what a cached copy of its history is of)
    owner: str = ""
    announced: str = ""  # the turn's call whose tool.started a commit wrote alone (resuming a paused step)


class LeaseTaken(Reply, tag="busy"):
    """Another runner holds the lease."""

    retry_ms: int


class InboxEmpty(Reply, tag="empty"):
    pass


class Waiting(Reply, tag="waiting"):
    pass


BeginReply = Began | LeaseTaken | InboxEmpty | Waiting | Missing


# ---- SUBMIT, ENQUEUE ---------------------------------------------------------------------


class SubmitArgs(msgspec.Struct, frozen=True):
    owner: str
    message_id: str
    turn_id: str
    entry: str  # the InboxMessage (JSON)
    retention: int
    body: str  # the message.received event body
    begin: BeginArgs | None = None  # begin the turn if the message is alone and the lease free
    create: CreateArgs | None = None  # create the session first if it does not exist
    max_queued: int = 0  # refuse ('full') when this many already wait behind the current turn
    ttl_ms: int = 0  # every key of the session expires this long from now (0: never)
    at: str = ""  # now: the session's updated_at
    preview: str = ""  # the start of the message (the session's preview)
    title: str = ""  # the session's title, if it has none yet (the start of the message)
    policy: MessagePolicy = "queue"  # what to do if a turn runs or waits
    steered: str = ""  # with "steer": the message.steered event's data (JSON)


class New(Reply, tag="new"):
    id: str  # its message.received (message.steered when it joined the running turn)
    seq: int
    began: BeginReply | None = None
    created: str | None = None  # the session.created id, when this message created its session
    steered: str | None = None  # the running turn it joined ("steer") ...
    body: str = ""  # ... and its message.steered's body
    interrupted: str | None = None  # the turn it asked to end ("interrupt")


class Rejected(Reply, tag="rejected"):
    """`reject`, and a turn runs or waits: nothing was written."""


class Full(Reply, tag="full"):
    """`max_queued` messages already wait: nothing was written."""


class Duplicate(Reply, tag="dup"):
    turn_id: str
    received_id: str


class EnqueueArgs(msgspec.Struct, frozen=True):
    owner: str
    entry: str  # the InboxMessage (JSON)
    max_queued: int = 0


# ---- COMMIT, USAGE, ATTEMPT --------------------------------------------------------------


class UsageArgs(msgspec.Struct, frozen=True):
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    body: str  # the usage.recorded event body
    cache_write_tokens: int = 0
    last_est: int | None = None  # with a turn call's report: keel's estimate of that request


class RequestArg(msgspec.Struct, frozen=True):
    request_id: str
    json: str  # the ApprovalRequest


class AnswerArg(msgspec.Struct, frozen=True):
    request_id: str
    json: str  # the Answer
    body: str  # its input.resolved event body, emitted if the answer is set


class EventArg(msgspec.Struct, frozen=True):
    type: str
    body: str


class CommitArgs(msgspec.Struct, frozen=True):
    fence: str
    turn_id: str
    retention: int
    mode: CommitMode
    waiting_on: list[str]  # pause: the request ids the turn waits for
    attempt: bool  # a model call follows: count it
    items: list[str]  # encoded Items, appended to history
    requests: list[RequestArg]
    answers: list[AnswerArg]
    events: list[EventArg]
    rebase: int | None = None  # the items become the whole active history; the turn's start at this offset
    usage: UsageArgs | None = None  # a model call's tokens, recorded first, fenced or not
    guard: bool = False  # with a cancel pending, write nothing but the usage
    announce: list[EventArg] = []  # events written only if no cancel is pending
    announced: str = ""  # the call whose tool.started this commit writes alone (a paused step's, resumed)
    ttl_ms: int = 0  # with 'final' or 'pause': every key of the session expires this long from now (0: never)
    at: str = ""  # with 'final' or 'pause': now, the session's updated_at
    preview: str = ""  # with 'final' or 'pause': the start of the turn's reply ("": leave the preview)


class Converted(msgspec.Struct, frozen=True):
    """A steered message's message.received, written when the turn ended before taking it."""

    id: str
    seq: int
    body: str


class CommitWritten(Reply):
    ids: list[str]  # the events written, in order
    length: int  # the history list's length after the commit
    first_seq: int  # the seq of the first of them
    resolved: list[int]  # which of the given answers were set (and emitted)
    cancel: bool = False  # a cancel was asked for this turn
    steered: list[str] = []  # steered messages that joined the turn: their user items (encoded), appended last
    received: list[Converted] = []  # final: steered messages no model call took, now the next turns


class StepDone(CommitWritten, tag="ok"):
    pass


class EndedMore(CommitWritten, tag="more"):
    """Final commit, and the inbox has another message: the lease is kept."""


class EndedIdle(CommitWritten, tag="done"):
    """Final commit, inbox empty: the lease is released."""


class PausedTurn(CommitWritten, tag="paused"):
    """The session now waits for answers; the lease is released."""


class DroppedStep(CommitWritten, tag="dropped"):
    """A guarded commit found a cancel pending: nothing but the usage was written."""


class Stale(Reply, tag="stale"):
    """The fence or the turn no longer match: nothing but the usage was written (nothing at all
    when the session is no more)."""


CommitReply = StepDone | EndedMore | EndedIdle | PausedTurn | DroppedStep | Stale


class RecordUsageArgs(msgspec.Struct, frozen=True):
    retention: int
    usage: UsageArgs


class NoArgs(msgspec.Struct, frozen=True):
    pass


# ---- RESPOND, CANCEL, RENEW, RELEASE -----------------------------------------------------


class RespondArgs(msgspec.Struct, frozen=True):
    owner: str
    request_id: str
    answer: str  # the Answer (JSON)
    retention: int
    now: str
    data: str  # the input.resolved event's data (JSON)
    message_id: str = ""  # the answering message's id, were it a message: known from now on (one answer)


class AnswerSet(Reply, tag="ok"):
    id: str
    seq: int
    body: str
    left: int  # the paused turn's requests still unanswered (-1: not one of them)


class Answered(Reply, tag="answered"):
    answer: str  # the answer recorded first (JSON)


class Unknown(Reply, tag="unknown"):
    pass


class CancelArgs(msgspec.Struct, frozen=True):
    owner: str
    turn_id: str  # "" for whichever turn is current
    once: str = ""  # the request's own id: a repeat of it changes nothing


class CancelSet(Reply, tag="ok"):
    turn_id: str


class Idle(Reply, tag="idle"):
    pass


class LeaseArgs(msgspec.Struct, frozen=True):
    fence: str
    ttl_ms: int = 0


class Held(msgspec.Struct, frozen=True):
    held: bool


class Count(msgspec.Struct, frozen=True):
    n: int


class ReadersArgs(msgspec.Struct, frozen=True):
    origin: str  # the process that has (or no longer has) readers of the session
    ttl_ms: int  # named for this long (0: no longer)


# ---- FORK --------------------------------------------------------------------------------


class HistoryArgs(msgspec.Struct, frozen=True):
    owner: str
    at: int = -1  # the first item's index, counted from the history's first item ever (-1: `offset`)
    offset: int = 0  # ... or from the active history's start
    limit: int = 0  # items at most (0: all)


class HistoryRead(Reply, tag="ok"):
    start: int  # where the active history begins (its first item's index)
    items: list[str] = []  # encoded Items


class Replaced(Reply, tag="replaced"):
    """The items asked for are no longer in the active history (a compaction or clear since)."""

    start: int


class ForkReadArgs(msgspec.Struct, frozen=True):
    owner: str
    message_id: str = ""  # the message the fork is to stop before ("": none)


class Source(Reply, tag="ok"):
    metadata: str  # JSON
    title: str
    turn: str  # the turn in progress ("" between turns)
    turn_start: int  # where it begins in the history list
    hist_start: int  # where the active history begins
    items: list[str]  # the active history (encoded Items)
    message_turn: str = ""  # the turn of `message_id` ("": no such message)
    queued: bool = False  # `message_id` waits in the inbox (its turn running, or to come)


class ForkArgs(msgspec.Struct, frozen=True):
    create: CreateArgs
    items: list[str]  # encoded Items: the new session's whole history
    title: str = ""  # the source's ("": none yet)
    preview: str = ""
    mids: list[tuple[str, str]] = []  # (message id, turn id) of the messages copied


# ---- UPDATE (PATCH) -----------------------------------------------------------------------


class UpdateArgs(msgspec.Struct, frozen=True):
    owner: str
    title: str | None = None  # the new title
    metadata: str | None = None  # the new metadata (JSON) ...
    expected: str = ""  # ... if the stored one is still this


class Changed(Reply, tag="changed"):
    """What the script was to check had changed since it was read: nothing was written (DELETE:
    a relay began on another destination since `relays` was read; UPDATE: the metadata)."""


# ---- DELETE ------------------------------------------------------------------------------


class DeleteArgs(msgspec.Struct, frozen=True):
    owner: str
    destinations: list[str]  # the session's `relays`, as the caller read them (their keys follow its own)


class Deleted(Reply, tag="ok"):
    turn_id: str  # the turn that was in progress ("" if none)


_SESSION = ("meta", "inbox", "lease", "history", "sticky", "outbox", "decisions", "readers")
# Every key of a session (`keep` in a script that names them all gives them one expiry).
_ALL = (*_SESSION, "pending", "mids", "relays", "steer")
CREATE: Script[Added | Exists] = Script(lua.CREATE, ("meta", "outbox", "readers"), Added | Exists)
ENQUEUE: Script[Done | Full | Missing] = Script(lua.ENQUEUE, ("meta", "inbox"), Done | Full | Missing)
BEGIN: Script[BeginReply] = Script(lua_turn.BEGIN, _SESSION, BeginReply)
SUBMIT: Script[New | Duplicate | Full | Rejected | Missing] = Script(
    lua_turn.SUBMIT, _ALL, New | Duplicate | Full | Rejected | Missing
)
COMMIT: Script[CommitReply] = Script(lua_turn.COMMIT, _ALL, CommitReply)
USAGE: Script[Added | Stale] = Script(lua_turn.USAGE, ("meta", "outbox", "readers"), Added | Stale)
ATTEMPT: Script[Count] = Script(lua_turn.ATTEMPT, ("meta",), Count)
RESPOND: Script[AnswerSet | Answered | Unknown | Missing] = Script(
    lua.RESPOND, ("meta", "pending", "decisions", "outbox", "mids", "readers"), AnswerSet | Answered | Unknown | Missing
)
CANCEL: Script[CancelSet | Idle | Missing] = Script(lua.CANCEL, ("meta", "inbox", "mids"), CancelSet | Idle | Missing)
RENEW: Script[Held] = Script(lua.RENEW, ("lease",), Held)
RELEASE: Script[Held] = Script(lua.RELEASE, ("lease", "meta"), Held)
# (the keys of each destination's delivery state and lease follow the session's own)
DELETE: Script[Deleted | Changed | Missing] = Script(lua.DELETE, (*_ALL, "noted"), Deleted | Changed | Missing)
UPDATE: Script[Done | Changed | Missing] = Script(lua.UPDATE, ("meta",), Done | Changed | Missing)
HISTORY: Script[HistoryRead | Replaced | Missing] = Script(
    lua.HISTORY, ("meta", "history"), HistoryRead | Replaced | Missing
)
FORK_READ: Script[Source | Missing] = Script(lua.FORK_READ, ("meta", "history", "mids", "inbox"), Source | Missing)
FORK: Script[Added | Exists] = Script(lua.FORK, ("meta", "outbox", "history", "mids", "readers"), Added | Exists)
READERS: Script[Count] = Script(lua.READERS, ("readers", "meta"), Count)
SCRIPTS: tuple[Script[object], ...] = (
    CREATE,
    ENQUEUE,
    BEGIN,
    SUBMIT,
    COMMIT,
    USAGE,
    ATTEMPT,
    RESPOND,
    CANCEL,
    RENEW,
    RELEASE,
    DELETE,
    UPDATE,
    HISTORY,
    FORK_READ,
    FORK,
    READERS,
)

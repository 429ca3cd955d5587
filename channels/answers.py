"""Wire types of keel's answers: what the HTTP handlers encode and the websocket sends besides
event envelopes. The OpenAPI document's answer schemas are these types' schemas, so the
document follows the code (`channels.openapi`). Requests and client frames: `channels.types`;
the session view is the harness's own (`SessionInfo`), the events the catalogue's
(`harness.events`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from harness.events import TurnStatus
from harness.types import Item, ItemKind, Role, TurnResult


class ErrorDetail(msgspec.Struct, omit_defaults=True):
    """`code`: stable and machine-readable; some errors add fields (a recorded `decision`)."""

    code: str
    message: str
    retry_after: int | None = None  # a websocket frame refused by a quota: seconds until it may come again


class ErrorEnvelope(msgspec.Struct):
    """Every error: `{"error": {"code", "message"}}` (`channels.errors`)."""

    error: ErrorDetail


class Health(msgspec.Struct):
    ok: bool


class NewSession(msgspec.Struct):
    session_id: str


class MessageAccepted(msgspec.Struct):
    session_id: str
    message_id: str
    # queued (waits its turn, or starts one), steered (joined the running turn), interrupting
    # (the turn in progress is being cancelled; this message runs next)
    handled: str = "queued"


class ResponseAccepted(msgspec.Struct):
    session_id: str
    request_id: str
    decision: str


class TurnQueued(msgspec.Struct):
    """A cancel's turn, or a compaction's or clear's id (the `turn_id` of its events)."""

    session_id: str
    turn_id: str


class SessionToken(msgspec.Struct):
    token: str
    expires_at: int  # Unix seconds


class ToolCallView(msgspec.Struct):
    id: str | None
    name: str
    arguments: dict[str, Any]


class HistoryItem(msgspec.Struct, omit_defaults=True):
    id: str
    role: Role
    text: str
    kind: ItemKind
    turn_id: str
    tool_calls: list[ToolCallView] | None = None
    tool_call_id: str | None = None  # a tool result's call, with its tool_name and is_error
    tool_name: str | None = None
    is_error: bool | None = None
    message_id: str | None = None


class HistoryPage(msgspec.Struct):
    items: list[HistoryItem]
    next_offset: int | None  # null after the last page
    next_cursor: str | None = None  # the same place, refused once a compaction or clear replaced the history


def history_item(item: Item) -> HistoryItem:
    out = HistoryItem(id=item.id, role=item.role, text=item.text, kind=item.kind, turn_id=item.turn_id)
    if item.tool_calls:
        out.tool_calls = [ToolCallView(c.id, c.name, c.arguments) for c in item.tool_calls]
    if item.tool_call_id is not None:
        out.tool_call_id, out.tool_name, out.is_error = item.tool_call_id, item.tool_name, item.is_error
    out.message_id = item.message_id
    return out


class Webhook(msgspec.Struct):
    id: str
    url: str
    events: list[str]
    description: str
    created_at: float
    disabled: str | None  # why deliveries stopped, else null


class WebhookCreated(Webhook):
    secret: str  # shown only in this answer


class WebhookList(msgspec.Struct):
    webhooks: list[Webhook]


class Failure(msgspec.Struct):
    session_id: str
    event_id: str
    error: str
    at: float
    lost: int = 0  # >0: that many events after `event_id` left the outbox undelivered (nothing to retry)


class FailureList(msgspec.Struct):
    failures: list[Failure]


class Retried(msgspec.Struct):
    retried: int


# ---- a settled turn, and the websocket's own server frames (events are `harness.events`')

# An event as it was stored (byte for byte what SSE sends); documented as the catalogue's `Event`.
RawEvent = Annotated[msgspec.Raw, msgspec.Meta(extra_json_schema={"$ref": "#/components/schemas/Event"})]


class SettledTurn(msgspec.Struct):
    """`POST .../messages?wait=true`: how the turn came out (`pending` past the timeout), its
    reply, and its events from its message.received on."""

    session_id: str
    message_id: str
    status: TurnStatus | Literal["pending"]
    reply: str | None
    events: list[RawEvent]


def settled(turn: TurnResult) -> SettledTurn:
    events = [msgspec.Raw(e.raw) for e in turn.events]
    return SettledTurn(turn.session_id, turn.message_id, turn.status, turn.reply, events)


class WsError(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    error: ErrorDetail
    ref: str | None = None  # the bad frame's `ref`, when it had one


class WsHeartbeat(msgspec.Struct, tag="heartbeat", tag_field="type"):
    at: float


class WsPong(msgspec.Struct, tag="pong", tag_field="type"):
    ref: str | None

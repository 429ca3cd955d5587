"""Wire types of keel's answers: what the HTTP handlers encode and the websocket sends besides
event envelopes. The OpenAPI document's answer schemas are these types' schemas, so the
document follows the code (`channels.openapi`). Requests and client frames: `channels.types`;
the session view, a settled turn and the event envelope are the harness's own (`SessionInfo`,
`TurnResult`, `Event`)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from harness.types import Item, ItemKind, Role


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


class SessionCreated(msgspec.Struct):
    session_id: str


class MessageAccepted(msgspec.Struct):
    session_id: str
    message_id: str


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


class FailureList(msgspec.Struct):
    failures: list[Failure]


class Retried(msgspec.Struct):
    retried: int


# ---- transient events and the websocket's own server frames


class DeltaData(msgspec.Struct):
    item_id: str
    delta: str
    offset: int  # where `delta` starts in the item's text, in characters


class MessageDelta(msgspec.Struct):
    """A piece of a reply as it streams (`harness.events.delta` writes these bytes): no id, no
    seq, never stored or replayed."""

    type: Literal["message.delta"]
    session_id: str
    turn_id: str
    at: float
    data: DeltaData


class DeletedData(msgspec.Struct):
    reason: Literal["deleted", "gone"]  # deleted: by DELETE; gone: found no longer there (expired, say)


class SessionDeleted(msgspec.Struct):
    """The last thing a reader of a session gets when the session ends (`harness.events.
    session_deleted` writes these bytes): on SSE as `event: session.deleted` without `id:`, then
    the stream ends; on the websocket as a frame, then a close (4404). Never stored or replayed."""

    type: Literal["session.deleted"]
    session_id: str
    turn_id: None
    at: float
    data: DeletedData


class WsError(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    error: ErrorDetail
    ref: str | None = None  # the bad frame's `ref`, when it had one


class WsHeartbeat(msgspec.Struct, tag="heartbeat", tag_field="type"):
    at: float


class WsPong(msgspec.Struct, tag="pong", tag_field="type"):
    ref: str | None

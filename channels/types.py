"""Wire types of the HTTP channel, validated at the edge (unknown fields are errors)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Text = Annotated[str, msgspec.Meta(min_length=1, pattern=r"\S")]  # not empty, not only whitespace
ContextValue = str | list[str] | dict[str, str | None] | None


class CreateSession(msgspec.Struct, forbid_unknown_fields=True):
    metadata: dict[str, Any] = {}


class ForkSession(msgspec.Struct, forbid_unknown_fields=True):
    before_message_id: str | None = None  # the fork's history stops before this message's turn


class UpdateSession(msgspec.Struct, forbid_unknown_fields=True):
    title: str | msgspec.UnsetType = msgspec.UNSET
    metadata: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET  # keys merged; a null value removes its key


Policy = Literal["queue", "steer", "interrupt", "reject"]  # a message sent while a turn runs or waits


class SendMessage(msgspec.Struct, forbid_unknown_fields=True):
    text: Text
    context: ContextValue = None
    message_id: str | None = None
    policy: Policy = "queue"


class Respond(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    decision: str
    reason: str = ""


class CancelTurn(msgspec.Struct, forbid_unknown_fields=True):
    turn_id: str | None = None


class Empty(msgspec.Struct, forbid_unknown_fields=True):
    """A command that takes no fields (compact, clear): an empty body or {}."""


# ---- websocket client frames: {"type": ..., ...}; `ref` (optional) is echoed in an error frame


class WsMessage(msgspec.Struct, tag="message", tag_field="type", forbid_unknown_fields=True):
    text: Text
    context: ContextValue = None
    message_id: str | None = None
    policy: Policy = "queue"
    ref: str | None = None


class WsRespond(msgspec.Struct, tag="respond", tag_field="type", forbid_unknown_fields=True):
    request_id: str
    decision: str
    reason: str = ""
    ref: str | None = None


class WsCancel(msgspec.Struct, tag="cancel", tag_field="type", forbid_unknown_fields=True):
    turn_id: str | None = None
    ref: str | None = None


class WsCompact(msgspec.Struct, tag="compact", tag_field="type", forbid_unknown_fields=True):
    ref: str | None = None


class WsClear(msgspec.Struct, tag="clear", tag_field="type", forbid_unknown_fields=True):
    ref: str | None = None


class WsPing(msgspec.Struct, tag="ping", tag_field="type", forbid_unknown_fields=True):
    ref: str | None = None


WsFrame = WsMessage | WsRespond | WsCancel | WsCompact | WsClear | WsPing

create_session_decoder = msgspec.json.Decoder(CreateSession)
update_session_decoder = msgspec.json.Decoder(UpdateSession)
fork_session_decoder = msgspec.json.Decoder(ForkSession)
ws_frame_decoder = msgspec.json.Decoder(WsFrame)
empty_decoder = msgspec.json.Decoder(Empty)
cancel_decoder = msgspec.json.Decoder(CancelTurn)
respond_decoder = msgspec.json.Decoder(Respond)
send_message_decoder = msgspec.json.Decoder(SendMessage)

"""What Slack and Linear sign: their webhook payloads as msgspec Structs, decoded at the edge.

Each Struct names the fields keel reads, typed as the platform sends them; any other field is
ignored (the platforms add fields), and a field keel reads that holds another type makes the
payload one keel refuses (`decode` raises ValueError: the webhook seam answers 400
`invalid_payload`, before anything is written). A payload is read for its `Kind` first and in
full only if keel acts on that kind, so the events and interactions keel does not take (a
`user_change`, whose `user` is an object; a `view_submission`) keep shapes of their own."""

from __future__ import annotations

from typing import TypeVar

import msgspec

T = TypeVar("T")


class Kind(msgspec.Struct):
    """The `type` of a payload (or of a Slack envelope's event), read before the rest."""

    type: str


def decode(decoder: msgspec.json.Decoder[T], data: bytes | str, what: str) -> T:
    """`data` decoded, or a ValueError saying what in it is of the wrong shape."""
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:  # (a ValidationError too: the message names the field)
        raise ValueError(f"{what}: {exc}") from None
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None


kind_decoder = msgspec.json.Decoder(Kind)


# ---- Slack: the Events API --------------------------------------------------------------------


class UrlVerification(msgspec.Struct):
    challenge: str


class Authorization(msgspec.Struct):
    user_id: str | None = None
    is_bot: bool = False


class EventCallback(msgspec.Struct):
    event: msgspec.Raw  # decoded once its kind is known
    team_id: str | None = None
    authorizations: list[Authorization] | None = None


class MessageEvent(msgspec.Struct):
    """An `app_mention` or a `message` event, of any subtype (an edit has no `user`, a bot's
    post a `bot_id`): all but `type` may be absent."""

    type: str
    subtype: str | None = None
    user: str | None = None
    channel: str | None = None
    team: str | None = None
    ts: str | None = None
    thread_ts: str | None = None
    text: str | None = None
    channel_type: str | None = None
    bot_id: str | None = None


# ---- Slack: interactivity (a click on a button) ----------------------------------------------


class Ref(msgspec.Struct):
    """`{"id": ...}`: the team, the user or the channel of a click."""

    id: str | None = None


class Container(msgspec.Struct):
    channel_id: str | None = None
    thread_ts: str | None = None


class ClickedMessage(msgspec.Struct):
    thread_ts: str | None = None


class Action(msgspec.Struct):
    action_id: str | None = None
    value: str | None = None  # a button's (other elements carry `selected_option` and such)


class BlockActions(msgspec.Struct):
    team: Ref | None = None  # null for an organization-wide install
    user: Ref | None = None
    actions: list[Action] = []
    channel: Ref | None = None
    container: Container | None = None
    message: ClickedMessage | None = None


class ButtonValue(msgspec.Struct):
    """The value of keel's approval buttons (`slack_out.approve_value`)."""

    s: str  # the session
    r: str  # the request
    a: str | None = None  # who asked


url_verification_decoder = msgspec.json.Decoder(UrlVerification)
event_callback_decoder = msgspec.json.Decoder(EventCallback)
message_event_decoder = msgspec.json.Decoder(MessageEvent)
block_actions_decoder = msgspec.json.Decoder(BlockActions)
button_value_decoder = msgspec.json.Decoder(ButtonValue)


# ---- Linear: AgentSessionEvent ---------------------------------------------------------------


class Stamp(msgspec.Struct, rename="camel"):
    """What `verify` reads of a signed webhook: when it was signed (ms since the epoch)."""

    webhook_timestamp: int | float


class LinearRef(msgspec.Struct):
    """`{"id": ...}`: a user."""

    id: str | None = None


class Comment(msgspec.Struct):
    body: str | None = None


class Issue(msgspec.Struct):
    identifier: str | None = None


class AgentSession(msgspec.Struct):
    id: str
    comment: Comment | None = None
    issue: Issue | None = None
    creator: LinearRef | None = None


class ActivityContent(msgspec.Struct):
    body: str | None = None


class AgentActivity(msgspec.Struct, rename="camel"):
    id: str
    user_id: str | None = None
    user: LinearRef | None = None
    signal: str | None = None
    content: ActivityContent | None = None
    body: str | None = None


class AgentSessionEvent(msgspec.Struct, rename="camel"):
    """`created` (with the prompt context) or `prompted` (with the prompt's activity)."""

    action: str
    organization_id: str
    agent_session: AgentSession
    prompt_context: str | None = None
    agent_activity: AgentActivity | None = None


stamp_decoder = msgspec.json.Decoder(Stamp)
agent_session_event_decoder = msgspec.json.Decoder(AgentSessionEvent)

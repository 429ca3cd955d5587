"""The Linear channel: agent sessions (`AgentSessionEvent` webhooks), on the webhook seam.

Inbound: `POST /v1/linear/webhook`, signed by Linear (`Linear-Signature`: hex HMAC-SHA256 of the
raw body, checked in constant time before anything is parsed), `webhookTimestamp` within 60 s;
then decoded with the Structs of `types`: a signed payload of another shape is 400
`invalid_payload` and changes nothing. A Linear agent session is one keel session (its id
derived from Linear's, owned by `linear:<organization>`). `created` starts it: its
`promptContext` (the issue, comments, guidance) is keyed page context `linear` (the model sees
the newest one every turn; it never enters history), and the comment that mentioned the agent,
if any, is the first message. `prompted` is a new message (the user's activity body); with the
`stop` signal it cancels the turn in progress instead; while an approval waits, a prompt that is
a selection or says approve or deny answers it. Message ids come from Linear's (the session's
for `created`, the prompt activity's for `prompted`), so a redelivery (`Linear-Delivery`) or
replay is one message.

Outbound: `linear_out.LinearDestination` (agent activities), driven by the delivery relay."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import Response

from channels.webhooks.base import Call, Cancel, Decide, Later, Submit, conversation_session
from channels.webhooks.linear_out import LinearDestination
from channels.webhooks.types import AgentSessionEvent, agent_session_event_decoder, decode, kind_decoder, stamp_decoder
from harness.errors import KeelError
from harness.relay import Destination, Outbound

log = logging.getLogger("keel.linear")
LINEAR_API = "https://api.linear.app/graphql"
WINDOW_MS = 60_000  # webhookTimestamp within a minute of now
LINEAR_ID = re.compile(r"^[A-Za-z0-9-]{1,64}$")
APPROVE = re.compile(r"^\s*(approve|approved|yes|ok)\b", re.I)
DENY = re.compile(r"^\s*(deny|denied|no|reject)\b", re.I)


@dataclass(frozen=True)
class LinearConfig:
    webhook_secret: str
    api_key: str
    api_url: str = LINEAR_API


def session_for(agent_session: str) -> str:
    """The keel session of a Linear agent session."""
    return conversation_session("linear", agent_session)


class LinearChannel:
    name = "linear"

    def __init__(self, config: LinearConfig) -> None:
        self.config = config
        self._secret = config.webhook_secret.encode()
        self.out = LinearDestination(config.api_url, config.api_key)
        self.destination: Destination = self.out

    def routes(self) -> list[tuple[str, str]]:
        return [("/v1/linear/webhook", "webhook")]

    async def start(self) -> None:
        await self.out.start()

    async def stop(self) -> None:
        await self.out.stop()

    def verify(self, body: bytes, headers: Headers) -> bool:
        given = headers.get("linear-signature", "")
        expected = hmac.new(self._secret, body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected.encode(), given.strip().lower().encode()):
            return False
        try:  # signed: now the freshness of what was signed
            stamp = decode(stamp_decoder, body, "the webhook").webhook_timestamp
        except ValueError:
            return False
        return abs(time.time() * 1000 - stamp) <= WINDOW_MS

    def interpret(self, route: str, body: bytes, headers: Headers) -> list[Call] | Response:
        if decode(kind_decoder, body, "the webhook").type != "AgentSessionEvent":
            return []
        event = decode(agent_session_event_decoder, body, "AgentSessionEvent")
        sid_linear = event.agent_session.id
        if not LINEAR_ID.match(sid_linear):
            return []
        sid, owner = session_for(sid_linear), f"linear:{event.organization_id}"
        if event.action == "created":
            return [self._created(event, sid, owner)]
        if event.action == "prompted":
            return self._prompted(event, sid, owner)
        return []

    def rejected(self, call: Call, error: KeelError) -> Later | None:
        log.warning("linear: %s refused: %s", type(call).__name__, error.code)
        if isinstance(call, Decide) and call.otherwise is not None and error.code == "queue_full":
            call = call.otherwise  # (nothing waited for an answer: its words were a message, refused)
        if not isinstance(call, Submit):
            return None
        # a session (or a prompt: past the queue) keel cannot take: Linear hears so (best effort,
        # after the ack) rather than seeing no activity at all
        if call.create is not None:
            where, body = call.create, f"keel could not take this session: {error.message}"
        elif call.origin is not None:
            where, body = call.origin, f"keel could not take this message: {error.message}"
        else:
            return None
        out = Outbound("post", f"refused:{call.message_id}", {"content": {"type": "error", "body": body}})

        async def run() -> None:
            await self.out.send(out, where, None)

        return Later(run)

    def _created(self, event: AgentSessionEvent, sid: str, owner: str) -> Submit:
        session = event.agent_session
        comment = session.comment.body if session.comment else None
        text = comment if comment and comment.strip() else "Please work on this issue."
        where = {
            "linear": {
                "agent_session": session.id,
                "organization": event.organization_id,
                "issue": session.issue.identifier if session.issue else None,
            }
        }
        context = event.prompt_context
        return Submit(
            session_id=sid,
            owner=owner,
            text=text,
            message_id=f"linear:{session.id}",
            author=(session.creator.id if session.creator else None) or "",
            context={"linear": context} if context else None,
            create=where,
        )

    def _prompted(self, event: AgentSessionEvent, sid: str, owner: str) -> list[Call]:
        activity = event.agent_activity
        if activity is None or not LINEAR_ID.match(activity.id):
            return []
        user = activity.user_id or (activity.user.id if activity.user else None) or ""
        if activity.signal == "stop":
            # (kept apart from the message ids, which have no second colon: the store keeps
            # both in one place, and a message id that names a stop is not a message there)
            return [Cancel(session_id=sid, owner=owner, once=f"linear:stop:{activity.id}")]
        body = (activity.content.body if activity.content else None) or activity.body or ""
        text = body.strip() or "(no text)"
        origin = {"linear": {"agent_session": event.agent_session.id, "organization": event.organization_id}}
        message = Submit(
            session_id=sid, owner=owner, text=text, message_id=f"linear:{activity.id}", author=user, origin=origin
        )
        decision = "approve" if APPROVE.match(text) else "deny" if DENY.match(text) else None
        if decision is None:
            return [message]
        # a selection, or a prompt saying approve / deny: the open request's answer, if one
        # waits (otherwise it is a message like any other)
        return [Decide(session_id=sid, owner=owner, request_id=None, decision=decision, by=user, otherwise=message)]

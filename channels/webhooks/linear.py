"""The Linear channel: agent sessions (`AgentSessionEvent` webhooks), on the webhook seam.

Inbound: `POST /v1/linear/webhook`, signed by Linear (`Linear-Signature`: hex HMAC-SHA256 of
the raw body, checked in constant time before anything is parsed), `webhookTimestamp` within
60 s. A Linear agent session is one keel session (its id derived from Linear's, owned by
`linear:<organization>`). `created` starts it: its `promptContext` (the issue, comments,
guidance) is keyed page context `linear` (the model sees the newest one every turn; it never
enters history), and the comment that mentioned the agent, if any, is the first message.
`prompted` is a new message (the user's activity body); with the `stop` signal it cancels the
turn in progress instead; while an approval waits, a prompt that is a selection or says approve
or deny answers it. Message ids come from Linear's (the session's for `created`, the prompt
activity's for `prompted`), so a redelivery (`Linear-Delivery`) or replay is one message.

Outbound: `linear_out.LinearDestination` (agent activities), driven by the delivery relay."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import Response

from channels.webhooks.base import Call, Cancel, Decide, Later, Submit, conversation_session
from channels.webhooks.linear_out import LinearDestination
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
            stamp = json.loads(body).get("webhookTimestamp")
        except (ValueError, AttributeError):
            return False
        return isinstance(stamp, int | float) and abs(time.time() * 1000 - stamp) <= WINDOW_MS

    def interpret(self, route: str, body: bytes, headers: Headers) -> list[Call] | Response:
        payload = json.loads(body)
        if not isinstance(payload, dict) or payload.get("type") != "AgentSessionEvent":
            return []
        agent_session = payload.get("agentSession") or {}
        sid_linear, org = agent_session.get("id"), payload.get("organizationId")
        if not isinstance(sid_linear, str) or not LINEAR_ID.match(sid_linear) or not isinstance(org, str):
            return []
        sid, owner = session_for(sid_linear), f"linear:{org}"
        if payload.get("action") == "created":
            return [self._created(payload, agent_session, sid, owner)]
        if payload.get("action") == "prompted":
            return self._prompted(payload, sid, owner)
        return []

    def rejected(self, call: Call, error: KeelError) -> Later | None:
        log.warning("linear: %s refused: %s", type(call).__name__, error.code)
        if not isinstance(call, Submit) or call.create is None:
            return None
        # a session keel cannot take: Linear hears so (best effort, after the ack) rather than
        # seeing no activity at all
        where, body = call.create, f"keel could not take this session: {error.message}"
        out = Outbound("post", f"refused:{call.message_id}", {"content": {"type": "error", "body": body}})

        async def run() -> None:
            await self.out.send(out, where, None)

        return Later(run)

    def _created(self, payload: dict[str, Any], agent_session: dict[str, Any], sid: str, owner: str) -> Submit:
        comment = (agent_session.get("comment") or {}).get("body")
        issue = agent_session.get("issue") or {}
        text = comment if isinstance(comment, str) and comment.strip() else "Please work on this issue."
        context = payload.get("promptContext")
        where = {
            "linear": {
                "agent_session": agent_session["id"],
                "organization": payload["organizationId"],
                "issue": issue.get("identifier") if isinstance(issue, dict) else None,
            }
        }
        creator = (agent_session.get("creator") or {}).get("id") or ""
        return Submit(
            session_id=sid,
            owner=owner,
            text=text,
            message_id=f"linear:{agent_session['id']}",
            author=str(creator),
            context={"linear": str(context)} if isinstance(context, str) and context else None,
            create=where,
        )

    def _prompted(self, payload: dict[str, Any], sid: str, owner: str) -> list[Call]:
        activity = payload.get("agentActivity") or {}
        activity_id = activity.get("id")
        if not isinstance(activity_id, str) or not LINEAR_ID.match(activity_id):
            return []
        user = str(activity.get("userId") or (activity.get("user") or {}).get("id") or "")
        if activity.get("signal") == "stop":
            return [Cancel(session_id=sid, owner=owner, once=f"linear:{activity_id}")]
        content = activity.get("content") or {}
        text = str(content.get("body") or activity.get("body") or "").strip() or "(no text)"
        message = Submit(session_id=sid, owner=owner, text=text, message_id=f"linear:{activity_id}", author=user)
        decision = "approve" if APPROVE.match(text) else "deny" if DENY.match(text) else None
        if decision is None:
            return [message]
        # a selection, or a prompt saying approve / deny: the open request's answer, if one
        # waits (otherwise it is a message like any other)
        return [Decide(session_id=sid, owner=owner, request_id=None, decision=decision, by=user, otherwise=message)]

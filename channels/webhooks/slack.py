"""The Slack channel: the Events API and interactivity (buttons), on the webhook seam.

Inbound: `POST /v1/slack/events` and `POST /v1/slack/interactivity`, signed by Slack (`v0`
HMAC-SHA256 of the raw body, 300 s window, checked in constant time by slack_sdk's
SignatureVerifier before anything is parsed). A conversation is one keel session per (team,
channel, thread root `ts`), its id derived from them, owned by `slack:<team>`; a message's id
is derived from (team, channel, ts), so Slack's retries, a message delivered both as
`app_mention` and as `message`, and replays are one message. An `app_mention`, a direct
message, or a message naming the bot starts (or continues) a conversation; a plain reply in a
thread continues it only if keel is already in that thread. The bot's own posts, edits,
deletions and joins are ignored. Who wrote the message and where travels as this turn's page
context, never in history.

Buttons: the value names the session, the request and the user whose message started the turn;
only that user, or one of `KEEL_SLACK_APPROVERS`, may decide. The decision goes the way of
`POST .../responses` (a double click is one answer; a different second decision is told, in an
ephemeral message, that the request was already answered).

Outbound: `slack_out.SlackDestination`, driven by the delivery relay."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import aiohttp
from slack_sdk.signature import SignatureVerifier
from slack_sdk.web.async_client import AsyncWebClient
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response

from channels.webhooks.base import Call, Decide, Later, Submit, conversation_session
from channels.webhooks.slack_out import SlackDestination
from harness.errors import Conflict, KeelError
from harness.relay import Destination

log = logging.getLogger("keel.slack")
SLACK_API = "https://slack.com/api/"
SLACK_ID = re.compile(r"^[A-Za-z0-9]{1,40}$")
SLACK_TS = re.compile(r"^\d{1,12}\.\d{1,8}$")
KEPT_SUBTYPES = frozenset({None, "thread_broadcast", "file_share"})  # other subtypes: edits, joins, bots...
ACTIONS = {"keel_approve": "approve", "keel_deny": "deny"}
WEB_API_CONNECTIONS = 32  # connections to the Web API a process keeps at most


@dataclass(frozen=True)
class SlackConfig:
    signing_secret: str
    bot_token: str
    api_url: str = SLACK_API
    approvers: frozenset[str] = frozenset()


def session_for(team: str, channel: str, thread_ts: str) -> str:
    """The keel session of a Slack conversation."""
    return conversation_session("slack", team, channel, thread_ts)


class SlackChannel:
    name = "slack"

    def __init__(self, config: SlackConfig, *, verifier: SignatureVerifier | None = None) -> None:
        self.config = config
        self.verifier = verifier or SignatureVerifier(config.signing_secret)
        self.client = AsyncWebClient(token=config.bot_token, base_url=config.api_url, timeout=10, retry_handlers=[])
        self.destination: Destination = SlackDestination(self.client)
        self.bot_user: str | None = None  # learned from auth.test at start, or from an envelope

    def routes(self) -> list[tuple[str, str]]:
        return [("/v1/slack/events", "events"), ("/v1/slack/interactivity", "interactivity")]

    async def start(self) -> None:
        # one HTTP session for every Web API call (slack_sdk opens one per call without it: a
        # new connection, and against Slack a TLS handshake, for every post)
        self.client.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.client.timeout),
            connector=aiohttp.TCPConnector(limit=WEB_API_CONNECTIONS),
        )
        try:
            res = await self.client.auth_test()
            self.bot_user = str(res.get("user_id") or "") or None
        except Exception as exc:  # Slack away at start: envelopes name the bot too
            log.warning("slack: auth.test failed (%s); the bot's user id comes from the next event", exc)

    async def stop(self) -> None:
        session, self.client.session = self.client.session, None
        if session is not None:
            await session.close()

    def verify(self, body: bytes, headers: Headers) -> bool:
        timestamp = headers.get("x-slack-request-timestamp")
        signature = headers.get("x-slack-signature")
        if not timestamp or not signature or not timestamp.isdigit():
            return False
        try:
            return self.verifier.is_valid(body, timestamp, signature)
        except ValueError:  # a body that is not UTF-8
            return False

    def interpret(self, route: str, body: bytes, headers: Headers) -> list[Call] | Response:
        if route == "events":
            return self._event(_object(json.loads(body)))
        form = parse_qs(body.decode(), max_num_fields=20)
        payload = form.get("payload")
        if not payload:
            raise ValueError("an interactivity request carries a payload field")
        return self._action(_object(json.loads(payload[0])))

    def rejected(self, call: Call, error: KeelError) -> Later | None:
        if isinstance(call, Decide) and isinstance(error, Conflict):
            decided = (error.details or {}).get("decision", "")
            return self._note(call, f"This request was already answered: {decided}.")
        log.info("slack: %s refused: %s", type(call).__name__, error.code)
        return None

    # ---- events ----------------------------------------------------------------------------

    def _event(self, envelope: dict[str, Any]) -> list[Call] | Response:
        kind = envelope.get("type")
        if kind == "url_verification":
            challenge = envelope.get("challenge")
            if not isinstance(challenge, str):
                raise ValueError("url_verification carries a challenge string")
            return JSONResponse({"challenge": challenge})
        event = envelope.get("event")
        if kind != "event_callback" or not isinstance(event, dict):
            return []
        if event.get("type") not in ("app_mention", "message"):
            return []
        bot = self._bot(envelope)
        user, channel, ts = event.get("user"), event.get("channel"), event.get("ts")
        team = envelope.get("team_id") or event.get("team")
        if event.get("bot_id") or event.get("subtype") not in KEPT_SUBTYPES or user == bot:
            return []
        if not all(isinstance(v, str) and SLACK_ID.match(v) for v in (user, channel, team)):
            return []
        if not isinstance(ts, str) or not SLACK_TS.match(ts):
            return []
        thread = event.get("thread_ts")
        root = thread if isinstance(thread, str) and SLACK_TS.match(thread) else ts
        text = str(event.get("text") or "")
        mention = f"<@{bot}>" if bot else None
        named = event.get("type") == "app_mention" or (mention is not None and mention in text)
        direct = event.get("channel_type") == "im"
        if not (named or direct or root != ts):
            return []  # a channel message that is not for keel
        if mention:
            text = text.replace(mention, " ")
        text = re.sub(r"\s+", " ", text).strip() or "(no text)"
        assert isinstance(user, str) and isinstance(channel, str) and isinstance(team, str)
        where = {"slack": {"team": team, "channel": channel, "thread_ts": root}}
        return [
            Submit(
                session_id=session_for(team, channel, root),
                owner=f"slack:{team}",
                text=text,
                message_id=f"slack:{team}:{channel}:{ts}",
                author=user,
                context=[f"Slack: this message is from user <@{user}> in channel {channel}."],
                create=where if named or direct else None,
            )
        ]

    def _bot(self, envelope: Mapping[str, Any]) -> str | None:
        for auth in envelope.get("authorizations") or []:
            if isinstance(auth, dict) and auth.get("is_bot") and isinstance(auth.get("user_id"), str):
                self.bot_user = self.bot_user or auth["user_id"]
                return str(auth["user_id"])
        return self.bot_user

    # ---- buttons ---------------------------------------------------------------------------

    def _action(self, payload: dict[str, Any]) -> list[Call]:
        if payload.get("type") != "block_actions":
            return []
        team = (payload.get("team") or {}).get("id")
        user = (payload.get("user") or {}).get("id")
        actions = payload.get("actions") or []
        if not isinstance(team, str) or not isinstance(user, str) or not actions:
            return []
        action = actions[0] if isinstance(actions[0], dict) else {}
        decision = ACTIONS.get(str(action.get("action_id")))
        if decision is None:
            return []
        value = _object(json.loads(str(action.get("value") or "{}")))
        sid, rid, author = value.get("s"), value.get("r"), value.get("a")
        if not isinstance(sid, str) or not isinstance(rid, str):
            raise ValueError("the button's value names no request")
        answer = Decide(
            session_id=sid, owner=f"slack:{team}", request_id=rid, decision=decision, by=user, origin=payload
        )
        if user != author and user not in self.config.approvers:
            who = f"<@{author}>" if author else "an approver"
            return [self._note(answer, f"Only {who} can decide on this request.")]
        return [answer]

    def _note(self, call: Decide, text: str) -> Later:
        """An ephemeral message to the user who clicked, in the thread of the button."""
        payload = call.origin or {}
        channel = (payload.get("channel") or {}).get("id") or (payload.get("container") or {}).get("channel_id")
        message = payload.get("message") or {}
        thread = message.get("thread_ts") or (payload.get("container") or {}).get("thread_ts")

        async def run() -> None:
            if channel:
                await self.client.chat_postEphemeral(channel=channel, user=call.by, text=text, thread_ts=thread)

        return Later(run)


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value

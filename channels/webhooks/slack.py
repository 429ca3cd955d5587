"""The Slack channel: the Events API and interactivity (buttons), on the webhook seam.

Inbound: `POST /v1/slack/events` and `POST /v1/slack/interactivity`, signed by Slack (`v0`
HMAC-SHA256 of the raw body, 300 s window, checked in constant time by slack_sdk's
SignatureVerifier before anything is parsed), then decoded with the Structs of `types` (the
fields keel reads, typed; others, and events keel does not take, pass untouched): a signed
payload of another shape is 400 `invalid_payload` and changes nothing. A conversation is one
keel session per (team, channel, thread root `ts`), its id derived from them, owned by
`slack:<team>`; a message's id is derived from (team, channel, ts), so Slack's retries, a
message delivered both as `app_mention` and as `message`, and replays are one message. An
`app_mention`, a direct message, or a message naming the bot starts (or continues) a
conversation; a plain reply in a thread continues it only if keel is already in that thread. The
bot's own posts, edits, deletions and joins are ignored. Who wrote the message and where travels
as this turn's page context, never in history.

Buttons: the value names the session, the request and the user whose message started the turn;
only that user, or one of `KEEL_SLACK_APPROVERS`, may decide. The decision goes the way of
`POST .../responses` (a double click is one answer; a different second decision is told, in an
ephemeral message, that the request was already answered).

Outbound: `slack_out.SlackDestination`, driven by the delivery relay."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard
from urllib.parse import parse_qs

import aiohttp
from slack_sdk.signature import SignatureVerifier
from slack_sdk.web.async_client import AsyncWebClient
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response

from channels.webhooks.base import Call, Decide, Later, Submit, conversation_session
from channels.webhooks.slack_out import SlackDestination
from channels.webhooks.types import (
    Container,
    EventCallback,
    block_actions_decoder,
    button_value_decoder,
    decode,
    event_callback_decoder,
    kind_decoder,
    message_event_decoder,
    url_verification_decoder,
)
from harness.errors import Conflict, KeelError
from harness.relay import Destination

log = logging.getLogger("keel.slack")
SLACK_API = "https://slack.com/api/"
SLACK_ID = re.compile(r"^[A-Za-z0-9]{1,40}$")
SLACK_TS = re.compile(r"^\d{1,12}\.\d{1,8}$")
KEPT_SUBTYPES = frozenset({None, "thread_broadcast", "file_share"})  # other subtypes: edits, joins, bots...
ACTIONS = {"keel_approve": "approve", "keel_deny": "deny"}
QUEUE_FULL = (
    "This message was not taken: too many messages already wait in this thread. Send it again once I have answered."
)
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
            return self._event(body)
        form = parse_qs(body.decode(), max_num_fields=20)
        payload = form.get("payload")
        if not payload:
            raise ValueError("an interactivity request carries a payload field")
        return self._action(payload[0])

    def rejected(self, call: Call, error: KeelError) -> Later | None:
        if isinstance(call, Decide) and isinstance(error, Conflict):
            decided = (error.details or {}).get("decision", "")
            return self._note(call.by, call.origin, f"This request was already answered: {decided}.")
        if isinstance(call, Submit) and error.code == "queue_full":
            log.info("slack: a message for %s refused: queue_full", call.session_id)
            return self._note(call.author, call.origin, QUEUE_FULL)
        log.info("slack: %s refused: %s", type(call).__name__, error.code)
        return None

    # ---- events ----------------------------------------------------------------------------

    def _event(self, body: bytes) -> list[Call] | Response:
        kind = decode(kind_decoder, body, "the envelope").type
        if kind == "url_verification":
            challenge = decode(url_verification_decoder, body, "url_verification").challenge
            return JSONResponse({"challenge": challenge})
        if kind != "event_callback":
            return []
        envelope = decode(event_callback_decoder, body, "event_callback")
        if decode(kind_decoder, envelope.event, "the event").type not in ("app_mention", "message"):
            return []
        event = decode(message_event_decoder, envelope.event, "the event")
        bot = self._bot(envelope)
        user, channel, ts = event.user, event.channel, event.ts
        team = envelope.team_id or event.team
        if event.bot_id or event.subtype not in KEPT_SUBTYPES or user == bot:
            return []
        if not (_is_id(user) and _is_id(channel) and _is_id(team)):
            return []
        if ts is None or not SLACK_TS.match(ts):
            return []
        thread = event.thread_ts
        root = thread if thread is not None and SLACK_TS.match(thread) else ts
        text = event.text or ""
        mention = f"<@{bot}>" if bot else None
        named = event.type == "app_mention" or (mention is not None and mention in text)
        direct = event.channel_type == "im"
        if not (named or direct or root != ts):
            return []  # a channel message that is not for keel
        if mention:
            text = text.replace(mention, " ")
        text = re.sub(r"\s+", " ", text).strip() or "(no text)"
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
                origin={"channel": channel, "thread_ts": root},
            )
        ]

    def _bot(self, envelope: EventCallback) -> str | None:
        for auth in envelope.authorizations or ():
            if auth.is_bot and auth.user_id is not None:
                self.bot_user = self.bot_user or auth.user_id
                return auth.user_id
        return self.bot_user

    # ---- buttons ---------------------------------------------------------------------------

    def _action(self, payload: str) -> list[Call]:
        if decode(kind_decoder, payload, "the payload").type != "block_actions":
            return []
        clicked = decode(block_actions_decoder, payload, "block_actions")
        team = clicked.team.id if clicked.team else None
        user = clicked.user.id if clicked.user else None
        if team is None or user is None or not clicked.actions:
            return []
        action = clicked.actions[0]
        decision = ACTIONS.get(action.action_id or "")
        if decision is None:
            return []
        if action.value is None:
            raise ValueError("the button's value names no request")
        value = decode(button_value_decoder, action.value, "the button's value")
        container = clicked.container or Container()
        where = {
            "channel": (clicked.channel.id if clicked.channel else None) or container.channel_id,
            "thread_ts": (clicked.message.thread_ts if clicked.message else None) or container.thread_ts,
        }
        answer = Decide(
            session_id=value.s, owner=f"slack:{team}", request_id=value.r, decision=decision, by=user, origin=where
        )
        if user != value.a and user not in self.config.approvers:
            who = f"<@{value.a}>" if value.a else "an approver"
            return [self._note(user, where, f"Only {who} can decide on this request.")]
        return [answer]

    def _note(self, user: str, where: Mapping[str, Any] | None, text: str) -> Later:
        """An ephemeral message to `user` (who clicked, or wrote), in the thread `where` names."""
        channel, thread = (where or {}).get("channel"), (where or {}).get("thread_ts")

        async def run() -> None:
            if channel and user:
                await self.client.chat_postEphemeral(channel=channel, user=user, text=text, thread_ts=thread)

        return Later(run)


def _is_id(value: str | None) -> TypeGuard[str]:
    return value is not None and SLACK_ID.match(value) is not None

"""Slack's outbound side: committed events rendered into Web API calls, made by the delivery
relay through slack_sdk's AsyncWebClient.

Every post goes in the session's thread (`thread_ts`) and carries its ref in the message's
`metadata` (`event_type` "keel_post"), so a relay that takes over after a crash finds what was
posted with `conversations.replies` (`include_all_metadata`) instead of posting it again.

Renderings: `message.completed` -> a reply (in the working post, if there is one, via
`chat.update`); `input.requested` -> one message per request with Approve and Deny buttons;
`input.resolved` -> that message updated to say who decided what, without buttons;
`turn.failed` -> a short apology with the error; `turn.cancelled` -> "Stopped."; a turn silent
for a second -> a working post, replaced by the reply."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from channels.webhooks.failures import UNREACHABLE, answered, unreachable
from harness.events import (
    InputRequested,
    InputResolved,
    MessageCompleted,
    StoredEvent,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
)
from harness.relay import Outbound, RetryPolicy, Undeliverable
from harness.telemetry import tracing

POST_TYPE = "keel_post"
TEXT_LIMIT = 3_900  # characters of one post; a longer reply goes out as several
# ok:false errors that say "not now" rather than "never"
TRANSIENT = frozenset({"ratelimited", "internal_error", "fatal_error", "service_unavailable", "request_timeout"})
MAX_PAGES = 50  # conversations.replies pages a reconcile reads at most
RENDERED = frozenset(
    c.TYPE for c in (MessageCompleted, InputRequested, InputResolved, TurnFailed, TurnCancelled, TurnCompleted)
)
_json = msgspec.json.Encoder()

DECIDED = {"approve": "Approved", "deny": "Denied", "withdrawn": "Withdrawn (the turn was cancelled)"}


def approve_value(sid: str, request_id: str, author: str) -> str:
    """The buttons' value: which request, and who asked (the default approver)."""
    return _json.encode({"s": sid, "r": request_id, "a": author}).decode()


def approval_blocks(text: str, value: str, request_id: str) -> list[dict[str, Any]]:
    return [
        {"type": "section", "text": {"type": "mrkdwn", "text": text}},
        {
            "type": "actions",
            "block_id": f"keel:{request_id}"[:255],
            "elements": [
                {
                    "type": "button",
                    "action_id": "keel_approve",
                    "text": {"type": "plain_text", "text": "Approve"},
                    "style": "primary",
                    "value": value,
                },
                {
                    "type": "button",
                    "action_id": "keel_deny",
                    "text": {"type": "plain_text", "text": "Deny"},
                    "style": "danger",
                    "value": value,
                },
            ],
        },
    ]


def _chunks(text: str) -> list[str]:
    text = text or "(no text)"
    return [text[i : i + TEXT_LIMIT] for i in range(0, len(text), TEXT_LIMIT)]


def thread_of(where: Mapping[str, Any]) -> tuple[str, str] | None:
    slack = where.get("slack")
    if not isinstance(slack, dict):
        return None
    channel, thread = slack.get("channel"), slack.get("thread_ts")
    return (channel, thread) if isinstance(channel, str) and isinstance(thread, str) else None


class SlackDestination:
    name = "slack"
    retry: RetryPolicy | None = None  # the relay's default: 6 attempts

    def __init__(self, client: AsyncWebClient) -> None:
        self.client = client

    # ---- rendering ----------------------------------------------------------------------

    def render(self, event: StoredEvent, where: Mapping[str, Any], refs: Mapping[str, str]) -> list[Outbound]:
        if event.type not in RENDERED or thread_of(where) is None:
            return []
        decoded = event.decoded()
        wait = f"wait:{decoded.turn_id}"
        match decoded:
            case MessageCompleted(data=data):
                return self._reply(event.id, data.text, wait, refs)
            case InputRequested(data=data):
                outs = self._settle(wait, refs, "_Waiting for approval._")
                for r in data.requests:
                    args = _json.encode(r.arguments).decode()
                    if len(args) > 2_000:
                        args = args[:2_000] + "…"
                    text = f"keel wants to run `{r.tool}` with `{args}`. Approve?"
                    value = approve_value(decoded.session_id, r.request_id, data.author)
                    body = {"text": text, "blocks": approval_blocks(text, value, r.request_id)}
                    outs.append(Outbound("post", f"req:{r.request_id}", body, keep=True))
                return outs
            case InputResolved(data=data):
                decided = DECIDED.get(data.decision, data.decision)
                by = f" by <@{data.by}>" if data.by else ""
                text = f"{decided}{by}: request `{data.request_id}`."
                body = {"text": text, "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}]}
                return [
                    Outbound("update", f"req:{data.request_id}", body),
                    Outbound("forget", f"req:{data.request_id}"),
                ]
            case TurnFailed(data=data):
                return self._reply(event.id, f"Sorry, that failed: {data.error.message}", wait, refs)
            case TurnCancelled():
                return self._reply(event.id, "_Stopped._", wait, refs)
        return self._settle(wait, refs, "_(no reply)_")  # turn.completed with a working post left

    def _reply(self, event_id: str, text: str, wait: str, refs: Mapping[str, str]) -> list[Outbound]:
        """The reply's parts, named by their place in the whole text; the first replaces the
        working post if there is one, and the post takes that part's name (in its metadata) so
        a later reconcile finds it under either."""
        parts = [(f"e:{event_id}:{n}", c) for n, c in enumerate(_chunks(text))]
        if wait not in refs:
            return [Outbound("post", ref, {"text": c}) for ref, c in parts]
        (first, text0), rest = parts[0], parts[1:]
        return [
            Outbound("update", wait, {"text": text0, "as": first}),
            Outbound("forget", wait),
            *(Outbound("post", ref, {"text": c}) for ref, c in rest),
        ]

    @staticmethod
    def _settle(wait: str, refs: Mapping[str, str], text: str) -> list[Outbound]:
        """The working post, if there is one, says `text` from now on (and is forgotten)."""
        if wait not in refs:
            return []
        return [Outbound("update", wait, {"text": text}), Outbound("forget", wait)]

    def working(self, turn_id: str, where: Mapping[str, Any]) -> Outbound | None:
        if thread_of(where) is None:
            return None
        return Outbound("post", f"wait:{turn_id}", {"text": "_Working on it…_"}, keep=True)

    # ---- calls --------------------------------------------------------------------------

    async def send(self, out: Outbound, where: Mapping[str, Any], handle: str | None) -> str:
        thread = thread_of(where)
        if thread is None:
            raise Undeliverable("the session has no Slack thread")
        channel, thread_ts = thread
        blocks = out.body.get("blocks")
        if out.kind == "update":
            assert handle is not None
            renamed = out.body.get("as")  # the post is a reply's part from now on
            try:
                await self._api(
                    "chat.update",
                    channel=channel,
                    ts=handle,
                    text=out.body["text"],
                    blocks=blocks or [{"type": "section", "text": {"type": "mrkdwn", "text": out.body["text"]}}],
                    metadata=_metadata(renamed) if renamed else None,
                )
            except Undeliverable as exc:
                if not renamed or "message_not_found" not in str(exc):
                    raise
                # the working post was deleted: the part is posted instead
                return await self.send(Outbound("post", renamed, {"text": out.body["text"]}), where, None)
            return handle
        res = await self._api(
            "chat.postMessage",
            channel=channel,
            thread_ts=thread_ts,
            text=out.body["text"],
            blocks=blocks,
            metadata=_metadata(out.ref),
        )
        return str(res["ts"])

    async def _api(self, method: str, **fields: Any) -> Any:
        """A Web API method, its fields as JSON (None ones left out, as slack_sdk's own methods
        do), with the delivery span's `traceparent` (tracing on) among the request's headers:
        slack_sdk's named methods take no headers."""
        body = {k: v for k, v in fields.items() if v is not None}
        return await self._call(self.client.api_call, api_method=method, json=body, headers=tracing.headers() or None)

    async def find(self, refs: list[str], where: Mapping[str, Any], since: str) -> dict[str, str]:
        thread = thread_of(where)
        if thread is None:
            return {}
        channel, thread_ts = thread
        wanted, found = set(refs), {}
        cursor = None
        for _ in range(MAX_PAGES):
            res = await self._call(
                self.client.conversations_replies,
                channel=channel,
                ts=thread_ts,
                oldest=since or thread_ts,
                inclusive=True,
                include_all_metadata=True,
                limit=200,
                cursor=cursor,
            )
            for message in res.get("messages") or []:
                meta = message.get("metadata") or {}
                ref = (meta.get("event_payload") or {}).get("ref")
                if meta.get("event_type") == POST_TYPE and ref in wanted:
                    found[ref] = str(message["ts"])
            cursor = (res.get("response_metadata") or {}).get("next_cursor")
            if not cursor or len(found) == len(wanted):
                break
        return found

    @staticmethod
    async def _call(method: Any, **kwargs: Any) -> Any:
        try:
            return await method(**kwargs)
        except SlackApiError as exc:
            error = str(exc.response.get("error", "")) if isinstance(exc.response.data, dict) else ""
            headers = {str(k): str(v) for k, v in (exc.response.headers or {}).items()}
            raise answered(
                "Slack", exc.response.status_code, headers, transient=error in TRANSIENT, error=error
            ) from None
        except UNREACHABLE as exc:
            raise unreachable("Slack", exc) from None


def _metadata(ref: str) -> dict[str, Any]:
    """What a post carries so a reconcile can tell it was made: its ref."""
    return {"event_type": POST_TYPE, "event_payload": {"ref": ref}}

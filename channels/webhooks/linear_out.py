"""Linear's outbound side: committed events rendered into agent activities
(`agentActivityCreate`), made by the delivery relay over Linear's GraphQL API.

Every activity carries an `id` derived from the session and the post's ref (a UUID in v4 form),
so the same activity sent again after a crash is the same activity: Linear's own idempotency
does the reconciling (`find` has nothing to ask).

Renderings: `turn.started` -> an ephemeral `thought` (Linear wants a first activity within 10 s
of `created`); `tool.started` -> an ephemeral `action`, `tool.completed` -> an `action` with its
result; `input.requested` -> an `elicitation` per request, with Approve / Deny as `select`
options; `turn.completed` -> the reply as a `response`; `turn.failed` -> an `error`;
`turn.cancelled` -> a final `response` ("Stopped.")."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec

from channels.webhooks.failures import UNREACHABLE, answered, not_now, unreachable
from harness.events import (
    InputRequested,
    StoredEvent,
    ToolCompleted,
    ToolStarted,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnStarted,
)
from harness.relay import Outbound, Retry, RetryPolicy, Undeliverable
from harness.telemetry import tracing

_json = msgspec.json.Encoder()
BODY_LIMIT = 10_000  # characters of an activity's body or result
RENDERED = frozenset(
    c.TYPE for c in (TurnStarted, ToolStarted, ToolCompleted, InputRequested, TurnCompleted, TurnFailed, TurnCancelled)
)
CREATE = """mutation Create($input: AgentActivityCreateInput!) {
  agentActivityCreate(input: $input) { success agentActivity { id } }
}"""
OPTIONS = {"options": [{"value": "Approve"}, {"value": "Deny"}]}


def activity_id(agent_session: str, ref: str) -> str:
    """The activity's id: the same for the same post, every time (a UUID in v4 form)."""
    return str(uuid.UUID(bytes=hashlib.sha256(f"{agent_session}\0{ref}".encode()).digest()[:16], version=4))


def session_of(where: Mapping[str, Any]) -> str | None:
    linear = where.get("linear")
    agent_session = linear.get("agent_session") if isinstance(linear, dict) else None
    return agent_session if isinstance(agent_session, str) else None


def _cut(text: str) -> str:
    return text if len(text) <= BODY_LIMIT else text[:BODY_LIMIT] + "…"


class LinearDestination:
    name = "linear"
    retry: RetryPolicy | None = None  # the relay's default: 6 attempts

    def __init__(self, api_url: str, api_key: str) -> None:
        self.api_url = api_url
        self.auth = api_key if api_key.startswith("lin_api_") else f"Bearer {api_key}"
        self.http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def stop(self) -> None:
        http, self.http = self.http, None
        if http is not None:
            await http.close()

    # ---- rendering ----------------------------------------------------------------------

    def render(self, event: StoredEvent, where: Mapping[str, Any], refs: Mapping[str, str]) -> list[Outbound]:
        if event.type not in RENDERED or session_of(where) is None:
            return []
        ref = f"e:{event.id}"
        match event.decoded():
            case TurnStarted():
                return [_activity(ref, {"type": "thought", "body": "Working on it…"}, ephemeral=True)]
            case ToolStarted(data=data):
                parameter = _json.encode(data.arguments).decode()
                return [_activity(ref, {"type": "action", "action": data.tool, "parameter": _cut(parameter)}, True)]
            case ToolCompleted(data=data):
                content = {"type": "action", "action": data.tool, "parameter": "", "result": _cut(data.result)}
                return [_activity(ref, content)]
            case InputRequested(data=data):
                outs = []
                for r in data.requests:
                    args = _json.encode(r.arguments).decode()
                    body = (
                        f"May I run `{r.tool}` with `{_cut(args)}`? Choose Approve or Deny (or reply approve / deny)."
                    )
                    outs.append(_activity(f"req:{r.request_id}", {"type": "elicitation", "body": body}, select=True))
                return outs
            case TurnCompleted(data=data):
                return [_activity(ref, {"type": "response", "body": _cut(data.reply or "Done.")})]
            case TurnFailed(data=data):
                return [_activity(ref, {"type": "error", "body": f"That failed: {data.error.message}"})]
        return [_activity(ref, {"type": "response", "body": "Stopped."})]  # turn.cancelled

    def working(self, turn_id: str, where: Mapping[str, Any]) -> Outbound | None:
        return None  # turn.started already says so

    # ---- calls --------------------------------------------------------------------------

    async def send(self, out: Outbound, where: Mapping[str, Any], handle: str | None) -> str:
        agent_session = session_of(where)
        if agent_session is None:
            raise Undeliverable("the session has no Linear agent session")
        input_: dict[str, Any] = {
            "id": activity_id(agent_session, out.ref),
            "agentSessionId": agent_session,
            "content": out.body["content"],
        }
        if out.body.get("ephemeral"):
            input_["ephemeral"] = True
        if out.body.get("select"):
            input_["signal"] = "select"
            input_["signalMetadata"] = OPTIONS
        res = await self._graphql(CREATE, {"input": input_})
        created = (res.get("agentActivityCreate") or {}) if isinstance(res, dict) else {}
        if not created.get("success"):
            raise Undeliverable("Linear did not create the activity")
        return str(input_["id"])

    async def find(self, refs: list[str], where: Mapping[str, Any], since: str) -> dict[str, str]:
        return {}  # an activity sent again has the same id: Linear makes it once

    async def _graphql(self, query: str, variables: dict[str, Any]) -> Any:
        assert self.http is not None, "LinearDestination.start() first"
        headers = {"Authorization": self.auth, "Content-Type": "application/json", **tracing.headers()}
        try:
            async with self.http.post(
                self.api_url, json={"query": query, "variables": variables}, headers=headers
            ) as r:
                if not_now(r.status):  # (a refusal's reasons are in its GraphQL errors, below)
                    raise answered("Linear", r.status, dict(r.headers))
                body = await r.json(content_type=None)
        except UNREACHABLE as exc:
            raise unreachable("Linear", exc) from None
        except ValueError:
            raise Retry("Linear answered something that is not JSON", None) from None
        errors = body.get("errors") if isinstance(body, dict) else None
        if errors:
            codes = {str((e.get("extensions") or {}).get("code", "")) for e in errors if isinstance(e, dict)}
            messages = "; ".join(str(e.get("message", "")) for e in errors if isinstance(e, dict))
            if "RATELIMITED" in codes:
                raise Retry("Linear rate limited", None)
            if "already exists" in messages.lower():  # the same activity id: made before
                return {"agentActivityCreate": {"success": True}}
            raise Undeliverable(f"Linear refused: {messages[:300]}")
        return body.get("data") if isinstance(body, dict) else None


def _activity(ref: str, content: dict[str, Any], ephemeral: bool = False, *, select: bool = False) -> Outbound:
    return Outbound("post", ref, {"content": content, "ephemeral": ephemeral, "select": select})

"""Outbound event webhooks, the API: `POST /v1/webhooks` `{"url", "events", "description"}` ->
201 `{"id", "secret", ...}`, `GET /v1/webhooks`, `GET` and `DELETE /v1/webhooks/{id}`,
`GET /v1/webhooks/{id}/failures`, `POST /v1/webhooks/{id}/failures/retry`. Each subscription is
visible only to the API key that made it (any other gets 404). Deliveries: `outbound.py`."""

from __future__ import annotations

import base64
import os
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from channels.errors import ChannelError
from channels.http import decode, harness_of, json_response, owner_of, read_body
from channels.webhooks.addresses import Refused, check_host, check_url
from harness.ids import new_id
from harness.store import DeadLetter, Subscription, new_subscription

EVENT_TYPES = frozenset(
    {
        "session.created",
        "message.received",
        "turn.started",
        "message.completed",
        "tool.started",
        "tool.completed",
        "input.requested",
        "input.resolved",
        "usage.recorded",
        "compaction.requested",
        "compaction.completed",
        "context.cleared",
        "turn.completed",
        "turn.failed",
        "turn.cancelled",
        "session.waiting",
    }
)
MAX_PER_KEY = 20
MAX_DESCRIPTION = 500


class CreateWebhook(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    events: list[str]
    description: str = ""


_create = msgspec.json.Decoder(CreateWebhook)


def view(sub: Subscription, *, secret: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": sub.id,
        "url": sub.url,
        "events": sub.events,
        "description": sub.description,
        "created_at": sub.created_at,
        "disabled": sub.disabled or None,
    }
    if secret:
        out["secret"] = sub.secret
    return out


async def create(request: Request) -> Response:
    body: CreateWebhook = decode(_create, await read_body(request))
    allow_private: bool = request.app.state.webhook_allow_private
    events = sorted(set(body.events))
    unknown = [e for e in events if e not in EVENT_TYPES and e != "*"]
    if not events or unknown:
        known = ", ".join(sorted(EVENT_TYPES))
        raise ChannelError(400, "invalid_events", f"events: one or more of {known} (or *), not {unknown or 'none'}")
    if len(body.description) > MAX_DESCRIPTION:
        raise ChannelError(400, "invalid_request", f"description is longer than {MAX_DESCRIPTION} characters")
    try:
        host, port = check_url(body.url, allow_private=allow_private)
        await check_host(host, port, allow_private=allow_private)
    except Refused as exc:
        raise ChannelError(400, "invalid_url", str(exc)) from None
    harness, owner = harness_of(request), owner_of(request)
    if await harness.hooks.count(owner) >= MAX_PER_KEY:
        raise ChannelError(409, "too_many_webhooks", f"an API key has at most {MAX_PER_KEY} webhooks")
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    sub = new_subscription(
        new_id("wh"), owner, url=body.url, events=events, secret=secret, description=body.description
    )
    await harness.hooks.add(sub)
    harness.forget_hooks(owner)
    return json_response(view(sub, secret=True), 201)


async def listing(request: Request) -> Response:
    subs = await harness_of(request).hooks.of(owner_of(request))
    return json_response({"webhooks": [view(s) for s in subs]})


async def _mine(request: Request) -> Subscription:
    sub = await harness_of(request).hooks.get(request.path_params["wid"][:64])
    if sub is None or sub.owner != owner_of(request):
        raise ChannelError(404, "webhook_not_found", "no such webhook")
    return sub


async def show(request: Request) -> Response:
    return json_response(view(await _mine(request)))


async def delete(request: Request) -> Response:
    sub = await _mine(request)
    harness = harness_of(request)
    await harness.hooks.remove(sub.owner, sub.id)
    harness.forget_hooks(sub.owner)
    return Response(status_code=204)


def _failure(d: DeadLetter) -> dict[str, Any]:
    return {"session_id": d.session_id, "event_id": d.event_id, "error": d.error, "at": d.at}


async def failures(request: Request) -> Response:
    sub = await _mine(request)
    letters = await harness_of(request).dead_letters(sub.destination)
    return json_response({"failures": [_failure(d) for d in letters]})


async def retry(request: Request) -> Response:
    sub = await _mine(request)
    if sub.disabled:
        raise ChannelError(409, "webhook_disabled", f"the webhook is disabled ({sub.disabled}): make a new one")
    harness = harness_of(request)
    n = await harness.retry_dead_letters(sub.destination)
    return json_response({"retried": n}, 202)

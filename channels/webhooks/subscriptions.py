"""Outbound event webhooks, the API: `POST /v1/webhooks` `{"url", "events", "description"}` ->
201 `{"id", "secret", ...}`, `GET /v1/webhooks`, `GET` and `DELETE /v1/webhooks/{id}`,
`GET /v1/webhooks/{id}/failures`, `POST /v1/webhooks/{id}/failures/retry`. Each subscription is
visible only to the API key that made it (any other gets 404). Deliveries: `outbound.py`."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from channels.answers import Failure, FailureList, Retried, Webhook, WebhookCreated, WebhookList
from channels.errors import ChannelError
from channels.http import decode, harness_of, json_response, owner_of, read_body
from channels.spec import Returns, operation
from channels.webhooks.addresses import Refused, check_host, check_url
from harness.events import TYPES as EVENT_TYPES
from harness.types import DeadLetter, Subscription

MAX_PER_KEY = 20
MAX_DESCRIPTION = 500


class CreateWebhook(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    events: list[str]
    description: str = ""


_create = msgspec.json.Decoder(CreateWebhook)


def view(sub: Subscription) -> Webhook:
    return Webhook(sub.id, sub.url, sub.events, sub.description, sub.created_at, sub.disabled or None)


NOT_FOUND = {404: "`webhook_not_found`: no such webhook, or another key's"}


@operation(
    "Subscribe a URL to the key's events",
    Returns(
        201,
        WebhookCreated,
        "The subscription, with its signing secret (shown only here)",
        provides={"wid": "$response.body#/id"},
    ),
    body=CreateWebhook,
    errors={
        400: "`invalid_request`, `invalid_json`, `invalid_url`, `invalid_events`",
        409: "`too_many_webhooks` (20 per key)",
    },
    tag="webhooks",
)
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
    webhooks, owner = harness_of(request).webhooks, owner_of(request)
    if await webhooks.count(owner) >= MAX_PER_KEY:
        raise ChannelError(409, "too_many_webhooks", f"an API key has at most {MAX_PER_KEY} webhooks")
    sub = await webhooks.subscribe(owner, url=body.url, events=events, description=body.description)
    created = WebhookCreated(sub.id, sub.url, sub.events, sub.description, sub.created_at, None, sub.secret)
    return json_response(created, 201)


@operation("The key's webhooks", Returns(200, WebhookList, "Every subscription of the key"), tag="webhooks")
async def listing(request: Request) -> Response:
    subs = await harness_of(request).webhooks.of(owner_of(request))
    return json_response(WebhookList([view(s) for s in subs]))


async def _mine(request: Request) -> Subscription:
    sub = await harness_of(request).webhooks.get(owner_of(request), request.path_params["wid"][:64])
    if sub is None:
        raise ChannelError(404, "webhook_not_found", "no such webhook")
    return sub


@operation("A webhook", Returns(200, Webhook, "The subscription"), errors=NOT_FOUND, tag="webhooks")
async def show(request: Request) -> Response:
    return json_response(view(await _mine(request)))


@operation("Delete a webhook", Returns(204, None, "Deleted"), errors=NOT_FOUND, tag="webhooks")
async def delete(request: Request) -> Response:
    sub = await _mine(request)
    await harness_of(request).webhooks.remove(sub.owner, sub.id)
    return Response(status_code=204)


def _failure(d: DeadLetter) -> Failure:
    return Failure(d.session_id, d.event_id, d.error, d.at, d.lost)


@operation(
    "A webhook's failed deliveries (dead letters)",
    Returns(200, FailureList, "Events it gave up on"),
    errors=NOT_FOUND,
    tag="webhooks",
)
async def failures(request: Request) -> Response:
    sub = await _mine(request)
    letters = await harness_of(request).webhooks.dead_letters(sub.destination)
    return json_response(FailureList([_failure(d) for d in letters]))


@operation(
    "Deliver a webhook's failures again",
    Returns(202, Retried, "How many are queued again"),
    errors={**NOT_FOUND, 409: "`webhook_disabled`"},
    tag="webhooks",
)
async def retry(request: Request) -> Response:
    sub = await _mine(request)
    if sub.disabled:
        raise ChannelError(409, "webhook_disabled", f"the webhook is disabled ({sub.disabled}): make a new one")
    n = await harness_of(request).webhooks.retry_dead_letters(sub.destination)
    return json_response(Retried(n), 202)

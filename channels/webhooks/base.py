"""The webhook channel seam. A chat tool (Slack, Linear, ...) is one `WebhookChannel`:

- `verify(body, headers)`: the provider's signature on the raw body, checked before anything
  is parsed (a request that fails it gets 401 and changes nothing);
- `interpret(route, body, headers)`: what a verified request asks of keel, as calls (`Submit`,
  `Decide`, `Cancel`) or an immediate reply (a URL challenge);
- `rejected(call, error)`: what to tell the person whose call keel refused (optional, made
  after the ack: a Slack ephemeral "already answered");
- `destination`: the outbound side, a `harness.relay.Destination` that renders committed events
  into the provider's calls; the delivery relay drives it from the outbox, never the turn.

`endpoint(channel, route)` is the one Starlette handler every webhook route shares: body read
within its limit, verified, interpreted, each call made (a submit, an answer or a cancel is one
Redis round trip, with the turn's job and the relay's job in it), then a 200 ack. No model or
provider call happens before the ack."""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from channels.errors import ChannelError, error_response
from channels.http import harness_of, read_body
from harness import Harness
from harness.errors import KeelError, Unavailable
from harness.relay import Destination

log = logging.getLogger("keel.webhooks")


@dataclass(frozen=True)
class Submit:
    """A message for the session (made on the conversation's first message with `create`)."""

    session_id: str
    owner: str
    text: str
    message_id: str
    author: str = ""
    context: str | list[str] | dict[str, str | None] | None = None
    create: Mapping[str, Any] | None = None  # the new session's metadata; None: only if it exists
    origin: Mapping[str, Any] | None = field(default=None, compare=False)  # where a note on it goes


@dataclass(frozen=True)
class Decide:
    """A person's decision on an approval request (`request_id` None: the first one the
    session waits for; if it waits for none, `otherwise` is sent instead, if given)."""

    session_id: str
    owner: str
    request_id: str | None
    decision: str
    by: str
    origin: Mapping[str, Any] | None = field(default=None, compare=False)  # where a note goes (channel, thread)
    otherwise: Submit | None = None


@dataclass(frozen=True)
class Cancel:
    session_id: str
    owner: str
    turn_id: str | None = None
    once: str = ""  # the provider's id of this request: a redelivery of it changes nothing


@dataclass(frozen=True)
class Later:
    """Something to do after the ack, not durably (a note only the clicking user sees)."""

    run: Callable[[], Awaitable[None]]


Call = Submit | Decide | Cancel | Later


class WebhookChannel(Protocol):
    name: str  # also its relay destination's name
    destination: Destination

    def routes(self) -> list[tuple[str, str]]:
        """(path, route name) for each route the channel serves; `interpret` gets the name."""
        ...

    def verify(self, body: bytes, headers: Headers) -> bool: ...

    def interpret(self, route: str, body: bytes, headers: Headers) -> list[Call] | Response: ...

    def rejected(self, call: Call, error: KeelError) -> Later | None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def conversation_session(channel: str, *parts: str) -> str:
    """The keel session of a channel's conversation, derived from the provider's ids: the same
    in every process, every time, so a message needs no look-up to find (or make) its session."""
    digest = hashlib.sha256("\0".join((channel, *parts)).encode()).digest()
    return "ses_" + base64.b32encode(digest[:16]).decode().lower()[:26]


def unauthorized() -> Response:
    return error_response(401, "invalid_signature", "the request's signature is missing, wrong or stale")


def endpoint(channel: WebhookChannel, route: str) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        body = await read_body(request)
        if not channel.verify(body, request.headers):
            return unauthorized()
        try:
            interpreted = channel.interpret(route, body, request.headers)
        except ValueError as exc:
            raise ChannelError(400, "invalid_payload", str(exc)[:200]) from None
        if isinstance(interpreted, Response):
            return interpreted
        later: list[Later] = []
        harness = harness_of(request)
        for call in interpreted:
            if isinstance(call, Later):
                later.append(call)
                continue
            try:
                await perform(harness, channel.name, call)
            except Unavailable:
                raise  # a 503: the provider retries, and a retry is one message
            except KeelError as exc:
                note = channel.rejected(call, exc)
                if note is not None:
                    # (a note on a message, once however often it comes: a Decide's is its `otherwise`'s)
                    said = call.otherwise if isinstance(call, Decide) and call.otherwise is not None else call
                    later.append(_once(harness, said, note) if isinstance(said, Submit) else note)
        return Response(b"", status_code=200, background=_after(later) if later else None)

    return handle


async def perform(harness: Harness, destination: str, call: Submit | Decide | Cancel) -> None:
    if isinstance(call, Submit):
        await harness.sessions.submit(
            call.session_id,
            call.owner,
            call.text,
            call.context,
            call.message_id,
            author=call.author,
            create=dict(call.create) if call.create is not None else None,
            deliver_to=destination,
            policy="steer",  # (a follow-up in a thread while a turn runs joins that turn)
        )
    elif isinstance(call, Decide):
        request_id = call.request_id
        if request_id is None:
            waiting = await harness.sessions.pending(call.session_id, call.owner)
            if not waiting:
                if call.otherwise is not None:
                    await perform(harness, destination, call.otherwise)
                return
            request_id = waiting[0]
        await harness.sessions.respond(
            call.session_id,
            call.owner,
            request_id,
            call.decision,
            by=call.by,
            deliver_to=destination,
            message_id=call.otherwise.message_id if call.otherwise is not None else "",
        )
    else:
        await harness.sessions.cancel(call.session_id, call.owner, call.turn_id, deliver_to=destination, once=call.once)


def _once(harness: Harness, call: Submit, note: Later) -> Later:
    """A note on a refused message, made once however often the message comes."""

    async def run() -> None:
        if await harness.sessions.first_note(call.session_id, call.message_id):
            await note.run()

    return Later(run)


def _after(later: list[Later]) -> BackgroundTask:
    async def run() -> None:
        for note in later:
            try:
                await note.run()
            except Exception as exc:  # a note is best effort: the decision itself is durable
                log.warning("webhooks: a note after the ack failed: %s", exc)

    return BackgroundTask(run)

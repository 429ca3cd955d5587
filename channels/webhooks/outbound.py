"""Outbound event webhooks, the deliveries: every committed event of an API key's sessions whose
type a subscription of that key wants is POSTed to its URL by the delivery relay (one relay
destination per subscription, `wh:<id>`, so a slow or failing receiver holds up only its own
deliveries), in order per session, at least once.

The body is the event's envelope, byte for byte what SSE sends. Standard Webhooks headers:
`webhook-id` = `<session_id>:<event id>` (unique across sessions, the same on every retry: the
receiver's idempotency key), `webhook-timestamp`, `webhook-signature` (`v1,<base64 HMAC>`,
signed with the `standardwebhooks` package). 2xx is delivered; 410 disables the subscription;
anything else (3xx and 4xx included: redirects are not followed), a timeout or a connection
error is tried again with a backoff doubling from about 1 s up to 10 minutes (a `Retry-After`,
in seconds or as a date, honoured)
for `KEEL_WEBHOOK_RETRY_HOURS`, then dead-lettered. Connections go only to public addresses
(`addresses.PublicResolver`) unless private targets are allowed."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp
import msgspec
from standardwebhooks import Webhook

from channels.webhooks.addresses import PublicResolver
from channels.webhooks.failures import UNREACHABLE, answered, unreachable
from harness import Harness
from harness.events import StoredEvent
from harness.relay import Destination, Outbound, RetryPolicy, Undeliverable
from harness.telemetry import tracing
from harness.types import Subscription

PREFIX = "wh:"


class WebhookDestination:
    def __init__(self, sub: Subscription, hooks: OutboundWebhooks) -> None:
        self.sub = sub
        self.name = sub.destination
        self.hooks = hooks
        self.retry: RetryPolicy | None = hooks.policy
        self.signer = Webhook(sub.secret)
        self.since = sub.created_at  # (epoch seconds) events committed from its creation on

    def render(self, event: StoredEvent, where: Mapping[str, Any], refs: Mapping[str, str]) -> list[Outbound]:
        if self.sub.disabled or (event.type not in self.sub.events and "*" not in self.sub.events):
            return []
        session_id = event.decoded().session_id
        return [Outbound("post", f"e:{event.id}", {"id": f"{session_id}:{event.id}", "raw": event.raw.decode()})]

    def working(self, turn_id: str, where: Mapping[str, Any]) -> Outbound | None:
        return None

    async def send(self, out: Outbound, where: Mapping[str, Any], handle: str | None) -> str:
        fresh = await self.hooks.webhooks.find(self.sub.id)  # deleted or disabled meanwhile?
        if fresh is None or fresh.disabled:
            self.sub = fresh or msgspec.structs.replace(self.sub, disabled="deleted")
        if self.sub.disabled:
            raise Undeliverable(f"the webhook is {self.sub.disabled if fresh is None else 'disabled'}")
        msg_id, raw = str(out.body["id"]), str(out.body["raw"])
        now = datetime.now(UTC)
        headers = {
            "Content-Type": "application/json",
            "webhook-id": msg_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": self.signer.sign(msg_id, now, raw),
            "User-Agent": "keel-webhooks",
            **tracing.headers(),  # (tracing on: the delivery's span)
        }
        http = self.hooks.http
        assert http is not None, "OutboundWebhooks.start() first"
        try:
            async with http.post(self.sub.url, data=raw.encode(), headers=headers, allow_redirects=False) as r:
                status, answer = r.status, dict(r.headers)
        except UNREACHABLE as exc:
            raise unreachable("the receiver", exc) from None
        if 200 <= status < 300:
            return msg_id
        if status == 410:
            why = "the receiver answered 410 Gone"
            await self.hooks.webhooks.disable(self.sub.id, why)
            self.sub = msgspec.structs.replace(self.sub, disabled=why)  # (every session's delivery stops)
            self.hooks.forget(self.sub.id)
            raise Undeliverable("the receiver answered 410 Gone: the webhook is disabled")
        raise answered("the receiver", status, answer, transient=True)  # (a 4xx may be a receiver's bug, fixed)

    async def find(self, refs: list[str], where: Mapping[str, Any], since: str) -> dict[str, str]:
        return {}  # at least once: a delivery in doubt is made again, with the same webhook-id


class OutboundWebhooks:
    """The subscriptions' relay destinations, made on demand (`resolve`), over one HTTP session
    that connects to public addresses only (unless `allow_private`)."""

    def __init__(self, harness: Harness, *, allow_private: bool, timeout: float, retry_hours: float) -> None:
        self.webhooks = harness.webhooks
        self.allow_private = allow_private
        self.timeout = timeout
        # a wait of more than a second gives the relay's slot back (resumed from a delayed job)
        self.policy = RetryPolicy(attempts=None, give_up_after=retry_hours * 3600, first=1.0, cap=600.0, park_after=1.0)
        self.http: aiohttp.ClientSession | None = None
        self._made: dict[str, WebhookDestination] = {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(resolver=PublicResolver(allow_private=self.allow_private), limit=256)
        self.http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout))

    async def stop(self) -> None:
        http, self.http = self.http, None
        if http is not None:
            await http.close()

    async def resolve(self, name: str) -> Destination | None:
        """The destination of a relay job for `wh:<id>`; None if there is no such subscription
        (deleted) or it is disabled. (Read again each time a relay starts on a session, so a
        deletion or a 410 elsewhere is seen.)"""
        if not name.startswith(PREFIX):
            return None
        sub = await self.webhooks.find(name[len(PREFIX) :])
        if sub is None or sub.disabled:
            self._made.pop(name, None)
            return None
        made = self._made.get(name)
        if made is None or made.sub != sub:
            if len(self._made) >= 10_000:
                self._made.clear()
            made = self._made[name] = WebhookDestination(sub, self)
        return made

    def forget(self, sub_id: str) -> None:
        self._made.pop(PREFIX + sub_id, None)

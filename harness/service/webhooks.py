"""`Harness.webhooks`: event webhook subscriptions and dead letters.

`Harness.webhooks`: an API key's outbound event webhook subscriptions (made, listed, shown,
removed) and the dead letters of any relay destination (listed and delivered again), the one
place dead letters are handled for the API and the operator's command line."""

from __future__ import annotations

import base64
import os

from harness.ids import new_id
from harness.store import Store, new_subscription
from harness.types import DeadLetter, Subscription


class Webhooks:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.subscriptions = store.hooks

    async def subscribe(self, owner: str, *, url: str, events: list[str], description: str = "") -> Subscription:
        """A new subscription of `owner`'s: `events` (type names, or "*") of its sessions are
        POSTed to `url`, signed with the returned subscription's `secret`."""
        secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
        sub = new_subscription(new_id("wh"), owner, url=url, events=events, secret=secret, description=description)
        await self.subscriptions.add(sub)
        return sub

    async def count(self, owner: str) -> int:
        return await self.subscriptions.count(owner)

    async def of(self, owner: str) -> list[Subscription]:
        """The owner's subscriptions, oldest first."""
        return await self.subscriptions.of(owner)

    async def get(self, owner: str, sub_id: str) -> Subscription | None:
        """The owner's subscription `sub_id` (None: no such one, or another owner's)."""
        sub = await self.subscriptions.get(sub_id)
        return sub if sub is not None and sub.owner == owner else None

    async def remove(self, owner: str, sub_id: str) -> bool:
        return await self.subscriptions.remove(owner, sub_id)

    async def find(self, sub_id: str) -> Subscription | None:
        """The subscription `sub_id`, whoever's it is (for its deliveries)."""
        return await self.subscriptions.get(sub_id)

    async def disable(self, sub_id: str, why: str) -> None:
        """Stop the subscription's deliveries (its receiver answered 410), saying why."""
        await self.subscriptions.disable(sub_id, why)

    async def dead_letters(
        self, destination: str, *, session: str | None = None, event: str | None = None
    ) -> list[DeadLetter]:
        """What the relay gave up delivering to `destination` (of one session or event)."""
        return await self.store.deliveries.dead(destination, session=session, event=event)

    async def retry_dead_letters(
        self, destination: str, *, session: str | None = None, event: str | None = None
    ) -> int:
        """Deliver them again (each reconciled with the destination first); how many."""
        return await self.store.deliveries.retry(destination, session=session, event=event)

"""Which relay destinations an owner's sessions deliver to: the owner's active event-webhook
subscriptions, cached for a second per owner in this process (a subscription made in another
process delivers from a second after it was made at the latest)."""

from __future__ import annotations

import time

from harness.store import Subscriptions

TTL_S = 1.0
MOST = 10_000  # owners cached at once (then the cache starts again)


class HookTargets:
    def __init__(self, subscriptions: Subscriptions) -> None:
        self.subscriptions = subscriptions
        self._cache: dict[str, tuple[float, list[str]]] = {}
        self._version: dict[str, int] = {}  # bumped when this process changes an owner's hooks

    async def of(self, owner: str) -> list[str]:
        """The relay destinations of the owner's active webhook subscriptions (an API key's: a
        webhook channel's sessions, which it names the destination of, have none)."""
        now = time.monotonic()
        cached = self._cache.get(owner)
        if cached is not None and cached[0] > now:
            return cached[1]
        version = self._version.get(owner, 0)
        destinations = [s.destination for s in await self.subscriptions.of(owner) if not s.disabled]
        if self._version.get(owner, 0) == version:  # (not changed here while it was read)
            if len(self._cache) >= MOST:
                self._cache.clear()
            self._cache[owner] = (now + TTL_S, destinations)
        return destinations

    def known_none(self, owner: str) -> bool:
        """Known here, without a round trip, to have no subscriptions."""
        cached = self._cache.get(owner)
        return cached is not None and cached[0] > time.monotonic() and not cached[1]

    def forget(self, owner: str) -> None:
        """The owner's subscriptions changed (in this process): read them again."""
        self._cache.pop(owner, None)
        self._version[owner] = self._version.get(owner, 0) + 1

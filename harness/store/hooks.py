"""Event webhook subscriptions, and where an owner's sessions deliver to.

Outbound event webhook subscriptions: per API key (owner), a URL, the event types it wants, and
the secret its deliveries are signed with. All in the `{hooks}` slot: `subs` (id -> the
subscription) and, per owner, the set of its ids, changed together (one script). With replicas
(`KEEL_DURABILITY=replica`) a change is acknowledged once a replica has it: a subscription
answered 201 and then lost in a failover would never deliver.

Which relay destinations an owner's sessions deliver to (`targets`) is read from them and cached
for a second per owner in this process (a subscription made in another process delivers from a
second after it was made at the latest; one made or removed here, at once)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from harness.store.client import Client, translated
from harness.store.clusterwire import AnyWire
from harness.store.keys import PREFIX
from harness.store.wire import raised
from harness.types import Subscription

SUBS = f"{PREFIX}:{{hooks}}:subs"
TARGETS_TTL_S = 1.0
TARGETS_MOST = 10_000  # owners whose targets are cached at once (then the cache starts again)
_decode = msgspec.json.Decoder(Subscription).decode
# (KEYS: subs, the owner's set; ARGV: the id, and the subscription to add)
_ADD = "redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) redis.call('SADD', KEYS[2], ARGV[1]) return 1"
_REMOVE = "redis.call('HDEL', KEYS[1], ARGV[1]) redis.call('SREM', KEYS[2], ARGV[1]) return 1"


def _owned(owner: str) -> str:
    return f"{PREFIX}:{{hooks}}:by:{owner}"


def new_subscription(
    sub_id: str, owner: str, *, url: str, events: list[str], secret: str, description: str
) -> Subscription:
    return Subscription(sub_id, owner, url, events, secret, description, round(time.time(), 3))


class Subscriptions:
    def __init__(self, redis: Client, wire: AnyWire) -> None:
        self.redis = redis
        self.wire = wire  # (changes go this way, and wait for its replicas, if any)
        self._targets: dict[str, tuple[float, list[str]]] = {}  # owner -> (until, destinations)
        self._version: dict[str, int] = {}  # bumped when this process changes an owner's hooks
        self._reading: dict[str, asyncio.Future[list[str]]] = {}  # owner -> its targets being read

    @translated
    async def add(self, sub: Subscription) -> None:
        await self._write(("EVAL", _ADD, 2, SUBS, _owned(sub.owner), sub.id, msgspec.json.encode(sub)))
        self._changed(sub.owner)

    async def _write(self, command: tuple[Any, ...]) -> None:
        raised(await self.wire.call([command], durable=True))

    @translated
    async def count(self, owner: str) -> int:
        return int(await self.redis.scard(_owned(owner)))

    @translated
    async def of(self, owner: str) -> list[Subscription]:
        ids: Any = await self.redis.smembers(_owned(owner))
        if not ids:
            return []
        raw: Any = await self.redis.hmget(SUBS, sorted(ids))
        subs = [_decode(r) for r in raw if r]
        return sorted((s for s in subs if s.owner == owner), key=lambda s: s.created_at)

    @translated
    async def get(self, sub_id: str) -> Subscription | None:
        raw: Any = await self.redis.hget(SUBS, sub_id)
        return _decode(raw) if raw else None

    @translated
    async def remove(self, owner: str, sub_id: str) -> bool:
        sub = await self.get(sub_id)
        if sub is None or sub.owner != owner:
            return False
        await self._write(("EVAL", _REMOVE, 2, SUBS, _owned(owner), sub_id))
        self._changed(owner)
        return True

    @translated
    async def disable(self, sub_id: str, why: str) -> None:
        sub = await self.get(sub_id)
        if sub is not None and not sub.disabled:
            await self._write(("HSET", SUBS, sub_id, msgspec.json.encode(msgspec.structs.replace(sub, disabled=why))))
            self._changed(sub.owner)

    # ---- where an owner's sessions deliver to ------------------------------------------------

    async def targets(self, owner: str) -> list[str]:
        """The relay destinations of the owner's active webhook subscriptions (an API key's: a
        webhook channel's sessions, which it names the destination of, have none). Callers
        that find the cache out of date together share one read."""
        cached = self._targets.get(owner)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        reading = self._reading.get(owner)
        if reading is None:
            reading = self._reading[owner] = asyncio.ensure_future(self._read_targets(owner))
            reading.add_done_callback(lambda done: self._read(owner, done))
        return await asyncio.shield(reading)  # (a caller that goes away leaves the read to the others)

    async def _read_targets(self, owner: str) -> list[str]:
        version = self._version.get(owner, 0)
        destinations = [s.destination for s in await self.of(owner) if not s.disabled]
        if self._version.get(owner, 0) == version:  # (not changed here while it was read)
            if len(self._targets) >= TARGETS_MOST:
                self._targets.clear()
            self._targets[owner] = (time.monotonic() + TARGETS_TTL_S, destinations)
        return destinations

    def _read(self, owner: str, done: asyncio.Future[list[str]]) -> None:
        if self._reading.get(owner) is done:
            del self._reading[owner]
        if not done.cancelled():
            done.exception()  # (retrieved: a failed read is its callers' to see, not the loop's)

    def known_none(self, owner: str) -> bool:
        """Known here, without a round trip, to have no subscriptions."""
        cached = self._targets.get(owner)
        return cached is not None and cached[0] > time.monotonic() and not cached[1]

    def _changed(self, owner: str) -> None:
        """The owner's subscriptions changed (in this process): read them again."""
        self._targets.pop(owner, None)
        self._reading.pop(owner, None)  # (a read begun before the change is not the answer now)
        self._version[owner] = self._version.get(owner, 0) + 1

"""Outbound event webhook subscriptions: per API key (owner), a URL, the event types it wants, and
the secret its deliveries are signed with. All in the `{hooks}` slot: `subs` (id -> the
subscription) and, per owner, the set of its ids, changed together (MULTI)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from harness.store.client import Client, translated
from harness.store.keys import PREFIX

SUBS = f"{PREFIX}:{{hooks}}:subs"


def _owned(owner: str) -> str:
    return f"{PREFIX}:{{hooks}}:by:{owner}"


class Subscription(msgspec.Struct, frozen=True):
    id: str
    owner: str
    url: str
    events: list[str]
    secret: str
    description: str = ""
    created_at: float = 0.0
    disabled: str = ""  # why deliveries stopped (the receiver answered 410), "" while active

    @property
    def destination(self) -> str:
        """Its delivery relay destination."""
        return f"wh:{self.id}"


_decode = msgspec.json.Decoder(Subscription).decode


class Subscriptions:
    def __init__(self, redis: Client) -> None:
        self.redis = redis

    @translated
    async def add(self, sub: Subscription) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(SUBS, sub.id, msgspec.json.encode(sub))
            pipe.sadd(_owned(sub.owner), sub.id)
            await pipe.execute()

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
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(SUBS, sub_id)
            pipe.srem(_owned(owner), sub_id)
            await pipe.execute()
        return True

    @translated
    async def disable(self, sub_id: str, why: str) -> None:
        sub = await self.get(sub_id)
        if sub is not None and not sub.disabled:
            await self.redis.hset(SUBS, sub_id, msgspec.json.encode(msgspec.structs.replace(sub, disabled=why)))


def new_subscription(
    sub_id: str, owner: str, *, url: str, events: list[str], secret: str, description: str
) -> Subscription:
    return Subscription(sub_id, owner, url, events, secret, description, round(time.time(), 3))

"""Quotas: the rate limits a channel checks before it makes work.

What one caller may ask of keel: a rate for the requests that make work (sessions, messages,
tokens) per API key, and one for the browser tokens minted for a session (`Quotas`, the
Harness's part channels ask). How many messages may wait in one session is the store's
(`max_queued`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from harness.errors import Limited
from harness.store import RateBuckets, Store

_UNITS = {
    "s": 1,
    "sec": 1,
    "second": 1,
    "m": 60,
    "min": 60,
    "minute": 60,
    "h": 3600,
    "hour": 3600,
    "d": 86400,
    "day": 86400,
}
_RATE = re.compile(r"([0-9]{1,9})\s*/\s*([a-z]+)")


@dataclass(frozen=True)
class RateLimit:
    """`count` per `period_s`, as a token bucket: bursts of up to `count`, refilled evenly."""

    count: int
    period_s: int

    @classmethod
    def parse(cls, text: str) -> RateLimit:
        """ "60/min", "10/s", "1000/hour", "5000/day"."""
        m = _RATE.fullmatch(text.strip().lower())
        if m is None or m.group(2) not in _UNITS or int(m.group(1)) < 1:
            raise ValueError(f"a rate looks like 60/min (per s, min, hour or day), not {text!r}")
        return cls(int(m.group(1)), _UNITS[m.group(2)])

    def __str__(self) -> str:
        unit = {1: "s", 60: "min", 3600: "hour", 86400: "day"}[self.period_s]
        return f"{self.count}/{unit}"


class RateLimiter:
    """A rate limit over buckets in Redis, one per key (an API key's owner, a session)."""

    def __init__(self, buckets: RateBuckets, limit: RateLimit, what: str) -> None:
        self.buckets, self.limit, self.what = buckets, limit, what

    async def admit(self, key: str) -> None:
        """Take one of `key`'s tokens, or raise Limited (`rate_limited`, with when to retry)."""
        wait_ms = await self.buckets.take(key, self.limit.count, self.limit.period_s * 1000)
        if wait_ms:
            after = max(1, math.ceil(wait_ms / 1000))
            raise Limited(
                f"over the rate limit of {self.limit} {self.what}; try again in {after} s",
                code="rate_limited",
                retry_after=after,
            )


class Quotas:
    """The rate limits a channel checks before it makes work."""

    def __init__(self, store: Store, rate_limit: RateLimit | None, token_rate: RateLimit | None) -> None:
        buckets = store.buckets
        self.limiter = RateLimiter(buckets, rate_limit, "for this API key") if rate_limit is not None else None
        self.token_limiter = RateLimiter(buckets, token_rate, "for this session's tokens") if token_rate else None

    async def admit(self, owner: str) -> None:
        """Count one request that makes work (a session, a message, a token) against `owner`'s
        rate limit, if there is one: Limited (`rate_limited`) past it. One round trip."""
        if self.limiter is not None:
            await self.limiter.admit(owner)

    async def admit_token(self, sid: str) -> None:
        """Count one browser token minted for session `sid` against its own limit (on by
        default: a token is a credential, and minting them needs no more than a page load's
        worth). Limited past it."""
        if self.token_limiter is not None:
            await self.token_limiter.admit(f"tokens:{sid}")

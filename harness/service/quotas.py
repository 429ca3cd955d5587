"""What one caller may ask of keel: a rate for the requests that make work (sessions, messages,
tokens) per API key, and how many messages may wait in one session."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from harness.errors import Limited
from harness.store import RateBuckets

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

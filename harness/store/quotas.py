"""Rate-limit buckets in Redis: one token bucket per caller, shared by every keel process."""

from __future__ import annotations

from harness.store import protocol_relay as p
from harness.store.client import translated
from harness.store.clusterwire import AnyWire
from harness.store.keys import QuotaKeys


class RateBuckets:
    def __init__(self, wire: AnyWire) -> None:
        self.wire = wire

    @translated
    async def take(self, owner: str, capacity: int, period_ms: int) -> int:
        """Take one token from `owner`'s bucket (`capacity` tokens, refilled over `period_ms`):
        0, or how many ms until one is there (nothing taken)."""
        script, args = p.TAKE_TOKEN, p.TakeTokenArgs(capacity, period_ms)
        raw = await self.wire.script(script.sha, script.source, script.keys(QuotaKeys(owner)), script.args(args))
        res = script.reply(raw)
        return res.retry_ms if isinstance(res, p.NoToken) else 0

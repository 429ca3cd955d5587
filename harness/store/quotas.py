"""Rate-limit buckets in Redis, and their script.

Rate-limit buckets in Redis: one token bucket per caller, shared by every keel process, taken
from by one script (`TAKE_TOKEN`, its arguments and replies here with it)."""

from __future__ import annotations

import msgspec

from harness.store.client import translated
from harness.store.clusterwire import AnyWire
from harness.store.keys import QuotaKeys
from harness.store.lua import _COMMON
from harness.store.protocol import Done, Reply, Script

# A token bucket (a caller's rate limit): `capacity` tokens, refilled at capacity per `period_ms`,
# on the server's clock (every process agrees). Takes one token, or says in how many ms one will
# be there. A full bucket needs no key: it expires when it would be full again.
_TAKE_TOKEN = (
    _COMMON
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local b = redis.call('HMGET', K.bucket, 'tokens', 'at')
local tokens = tonumber(b[1]) or A.capacity
local at = tonumber(b[2]) or now
if now > at then tokens = math.min(A.capacity, tokens + (now - at) * A.capacity / A.period_ms) end
if tokens < 1 then
  return reply({tag = 'limited', retry_ms = math.ceil((1 - tokens) * A.period_ms / A.capacity)})
end
redis.call('HSET', K.bucket, 'tokens', tostring(tokens - 1), 'at', now)
redis.call('PEXPIRE', K.bucket, A.period_ms)
return reply({tag = 'ok'})
"""
)


class TakeTokenArgs(msgspec.Struct, frozen=True):
    capacity: int
    period_ms: int


class NoToken(Reply, tag="limited"):
    """No token: one will be there in `retry_ms`."""

    retry_ms: int


TAKE_TOKEN: Script[Done | NoToken] = Script(_TAKE_TOKEN, ("bucket",), Done | NoToken)
SCRIPTS: tuple[Script[object], ...] = (TAKE_TOKEN,)


class RateBuckets:
    def __init__(self, wire: AnyWire) -> None:
        self.wire = wire

    @translated
    async def take(self, owner: str, capacity: int, period_ms: int) -> int:
        """Take one token from `owner`'s bucket (`capacity` tokens, refilled over `period_ms`):
        0, or how many ms until one is there (nothing taken)."""
        script, args = TAKE_TOKEN, TakeTokenArgs(capacity, period_ms)
        raw = await self.wire.script(script.sha, script.source, script.keys(QuotaKeys(owner)), script.args(args))
        res = script.reply(raw)
        return res.retry_ms if isinstance(res, NoToken) else 0

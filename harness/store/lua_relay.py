"""The delivery relay's Lua scripts.

The delivery relay's scripts (keys: `DeliveryKeys`, `RelayKeys`). Each is a body as the
session's scripts in `lua` are (`protocol.Script` puts the prelude in front of it, and it
answers one MessagePack map), built on `lua`'s shared helpers.
"""

from __future__ import annotations

from harness.store.lua import _COMMON, _KEEP
from harness.store.streamids import LUA_NEWER

# ---- the delivery relay (keys: DeliveryKeys) ------------------------------------------------

# Takes (or keeps) the lease of one session's deliveries to one destination, and answers the
# delivery state with where the session is: so a relay that takes over starts from the cursor,
# knows which posts are in doubt, and whether there is anything left to deliver. The session
# lists the destination among its `relays` (so that DELETE finds these keys), the list expiring
# with the session.
RELAY_TAKE = (
    _COMMON
    + _KEEP
    + """
if not redis.call('SET', K.lease, A.fence, 'NX', 'PX', A.ttl_ms) then
  if redis.call('GET', K.lease) ~= A.fence then
    return reply({tag = 'busy', retry_ms = redis.call('PTTL', K.lease)})
  end
  redis.call('PEXPIRE', K.lease, A.ttl_ms)
end
local metadata = redis.call('HGET', K.meta, 'metadata') or ''
if metadata ~= '' and redis.call('SADD', K.relays, A.destination) == 1 then expire_with_meta(K.relays) end
return reply({tag = 'held', state = pairs_of(redis.call('HGETALL', K.state)), metadata = metadata})
"""
)

# Writes delivery state if the caller still holds the lease (a relay that lost it changes
# nothing), and renews the lease, or with `A.release` gives it up. With `A.check`, also says
# whether the session is quiet: `A.check` is its newest event, and it waits for an answer (the
# answer queues a relay job), or is idle with nothing queued. The state expires with the session;
# a session that is no more (deleted, expired) gets no state written.
RELAY_MARK = (
    _COMMON
    + _KEEP
    + LUA_NEWER
    + """
if redis.call('GET', K.lease) ~= A.token then return reply({tag = 'lost'}) end
local quiet = false
if A.check then
  local status = redis.call('HGET', K.meta, 'status')
  local newest = redis.call('XREVRANGE', K.outbox, '+', '-', 'COUNT', 1)
  local last = newest[1] and newest[1][1] or ''
  local settled = status == 'waiting' or (status ~= 'running' and redis.call('LLEN', K.inbox) == 0)
  -- caught up: the newest event is the one seen, or before it (a relay that starts later than
  -- the session, at its destination's beginning)
  quiet = settled and not newer(last, A.check)
  if not quiet and A.release then return reply({tag = 'held', quiet = false}) end
end
if (#A.set > 0 or #A.unset > 0) and redis.call('EXISTS', K.meta) == 1 then
  if #A.set > 0 then
    local flat = {}
    for _, kv in ipairs(A.set) do flat[#flat + 1] = kv[1]; flat[#flat + 1] = kv[2] end
    redis.call('HSET', K.state, unpack(flat))
  end
  if #A.unset > 0 then redis.call('HDEL', K.state, unpack(A.unset)) end
  expire_with_meta(K.state)
end
if A.release then redis.call('DEL', K.lease) else redis.call('PEXPIRE', K.lease, A.ttl_ms) end
return reply({tag = 'held', quiet = quiet})
"""
)

# Moves the delayed relay jobs that are due (`A.now`, ms) to the relay's job stream: a delivery
# that waits long for its destination gives its relay slot back and comes back here.
RELAY_PROMOTE = (
    _COMMON
    + """
local due = redis.call('ZRANGEBYSCORE', K.later, '-inf', A.now, 'LIMIT', 0, A.limit)
for _, what in ipairs(due) do
  redis.call('ZREM', K.later, what)
  redis.call('XADD', K.jobs, '*', 's', what)
end
return reply({n = #due})
"""
)

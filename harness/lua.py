"""The atomic operations on a session, as Lua scripts. Each touches only keys of one session
(one hash tag, so one cluster slot) and is the only way the harness changes that session.

Events are stored as stream fields `s` (seq), `t` (type) and `b` (the envelope's JSON after
`session_id`: `"turn_id":...,"at":...,"data":...}`); readers add `id`, `seq`, `type` and
`session_id` in front, so a redelivered event is byte-identical to its first delivery.
"""

from __future__ import annotations

# Shared helpers, prepended to every script that emits events.
_EMIT = """
local function emit(meta, outbox, retention, etype, body)
  local seq = redis.call('HINCRBY', meta, 'seq', 1)
  return redis.call('XADD', outbox, 'MAXLEN', '~', retention, '*', 's', seq, 't', etype, 'b', body)
end
"""

# KEYS: meta, outbox. ARGV: owner, created_at, metadata_json, retention, event_body
CREATE = (
    _EMIT
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'created_at', ARGV[2], 'metadata', ARGV[3],
  'status', 'idle', 'seq', 0, 'fence', 0, 'turn', '', 'turn_start', 0, 'hist_start', 0)
local id = emit(KEYS[1], KEYS[2], ARGV[4], 'session.created', ARGV[5])
return {'ok', id}
"""
)

# KEYS: meta, inbox, mids, outbox.
# ARGV: owner, message_id, turn_id, inbox_json_tail (the encoded InboxMessage without its
#       opening brace), retention, event_body
SUBMIT = (
    _EMIT
    + """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner or owner ~= ARGV[1] then return {'missing'} end
local prev = redis.call('HGET', KEYS[3], ARGV[2])
if prev then return {'dup', prev} end
local id = emit(KEYS[1], KEYS[4], ARGV[5], 'message.received', ARGV[6])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3] .. ' ' .. id)
redis.call('RPUSH', KEYS[2], '{"received_id":"' .. id .. '",' .. ARGV[4])
if redis.call('HGET', KEYS[1], 'status') == 'idle' then redis.call('HSET', KEYS[1], 'status', 'running') end
return {'new', id}
"""
)

# Takes the session for one turn: lease with a new fencing token, keyed context applied,
# turn.started emitted once per turn, and everything the turn needs to run, in one trip.
# History comes back from `have_start + have_len` on when the caller's cached copy starts at
# the same index and is not longer than the list; else all of the active history.
# KEYS: meta, inbox, lease, history, sticky, outbox.
# ARGV: current_fence (this runner's token, or ''), lease_ttl_ms, now, retention, have_start, have_len
BEGIN = (
    _EMIT
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local head = redis.call('LINDEX', KEYS[2], 0)
if not head then return {'empty'} end
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[1] then return {'busy', redis.call('PTTL', KEYS[3])} end
local fence = redis.call('HINCRBY', KEYS[1], 'fence', 1)
redis.call('SET', KEYS[3], fence, 'PX', ARGV[2])
local m = cjson.decode(head)
local started = ''
if redis.call('HGET', KEYS[1], 'turn') ~= m.turn_id then
  if type(m.sticky) == 'table' then
    for k, v in pairs(m.sticky) do
      if v == cjson.null then redis.call('HDEL', KEYS[5], k)
      elseif type(v) == 'string' then redis.call('HSET', KEYS[5], k, v) end
    end
  end
  redis.call('HSET', KEYS[1], 'turn', m.turn_id, 'turn_start', redis.call('LLEN', KEYS[4]), 'status', 'running')
  started = emit(KEYS[1], KEYS[6], ARGV[4], 'turn.started', '"turn_id":"' .. m.turn_id .. '","at":' .. ARGV[3] ..
    ',"data":{"message_id":' .. cjson.encode(m.message_id) .. '}}')
end
local start = tonumber(redis.call('HGET', KEYS[1], 'hist_start'))
local turn_start = tonumber(redis.call('HGET', KEYS[1], 'turn_start'))
local from = start
local have = tonumber(ARGV[6])
if tonumber(ARGV[5]) == start and start + have <= redis.call('LLEN', KEYS[4]) then from = start + have end
return {'ok', fence, head, turn_start - start, redis.call('HGETALL', KEYS[5]),
  redis.call('LRANGE', KEYS[4], from, -1), start, from - start, started}
"""
)

# One step's results, its events and its usage, guarded by the fencing token; with final=1
# also the end of the turn: the message leaves the inbox and the lease is released if the
# inbox is empty (else kept for the next turn).
# KEYS: meta, lease, history, outbox, inbox.
# ARGV: fence, turn_id, retention, final, u_in, u_out, u_cached, u_calls, n_items,
#       items..., then (type, body) pairs
COMMIT = (
    _EMIT
    + """
if redis.call('GET', KEYS[2]) ~= ARGV[1] or redis.call('HGET', KEYS[1], 'turn') ~= ARGV[2] then
  return {'stale'}
end
local n = tonumber(ARGV[9])
local length = redis.call('LLEN', KEYS[3])
if n > 0 then length = redis.call('RPUSH', KEYS[3], unpack(ARGV, 10, 9 + n)) end
if ARGV[8] ~= '0' then
  redis.call('HINCRBY', KEYS[1], 'u_in', ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'u_out', ARGV[6])
  redis.call('HINCRBY', KEYS[1], 'u_cached', ARGV[7])
  redis.call('HINCRBY', KEYS[1], 'u_calls', ARGV[8])
end
local ids = {}
for i = 10 + n, #ARGV, 2 do
  ids[#ids + 1] = emit(KEYS[1], KEYS[4], ARGV[3], ARGV[i], ARGV[i + 1])
end
if ARGV[4] == '1' then
  redis.call('LPOP', KEYS[5])
  local left = redis.call('LLEN', KEYS[5])
  redis.call('HSET', KEYS[1], 'turn', '', 'status', left > 0 and 'running' or 'idle')
  if left == 0 then redis.call('DEL', KEYS[2]); return {'done', ids, length} end
  return {'more', ids, length}
end
return {'ok', ids, length}
"""
)

# KEYS: lease. ARGV: fence, ttl_ms. Extends the lease only for its owner.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: lease. ARGV: fence. Gives the lease up only for its owner.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

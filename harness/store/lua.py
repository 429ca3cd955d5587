"""The atomic operations on a session, as Lua scripts.

The atomic operations on a session, as Lua scripts. Each touches only keys of one session
(one hash tag, so one cluster slot) and is the only way the harness changes that session.

Each script here is a body: `protocol.Script` puts in front of it the prelude that names its
keys (`K.meta`, `K.inbox`, ...) and unpacks its one argument, a MessagePack map, into `A`
(fields as the script's `...Args` Struct in `protocol` names them). Every script answers one
MessagePack map (`reply`), decoded by `protocol` into the Struct of the same fields.

Events are stored as stream fields `s` (seq), `t` (type) and `b` (the envelope's JSON after
`session_id`: `"turn_id":...,"at":...,"data":...}`); readers add `id`, `seq`, `type` and
`session_id` in front, so a redelivered event is byte-identical to its first delivery. Stored
JSON from Python is never decoded and re-encoded here (cjson would change numbers).

Meta fields: owner, created_at, metadata, status (idle|running|waiting), seq, fence, turn (the
turn in progress), turn_start, hist_start (where the turn's items and the active history begin in
the history, counted from its first item ever: the list holds the active history only, the items
a compaction or a clear replaced are dropped, and hist_base says how many were),
u_in/u_out/u_cached/u_cwrite/u_calls (usage), last_in/last_est (the provider-reported
input tokens of the last turn call and keel's estimate of that request, for compaction),
waiting_on (the request ids the paused turn waits for), undecided (how many of them are
unanswered), cancel (the turn a cancel was asked for), held (1 while a runner runs the turn in
progress: a BEGIN that finds it so took the turn over from a lapsed lease).

The inbox holds user messages and, queued among them, manual compact and clear entries (`kind`);
the current turn is always the inbox head.

A session ends two ways, and all of it at once: DELETE removes every key of it, and with a
session TTL (`ttl_ms`) every key but the lease expires at the same moment (`keep`,
`expire_with_meta` below). A script that finds no meta writes nothing (a runner's write after
the end is refused), so nothing of a session that ended is made again.

The turn's scripts (SUBMIT, BEGIN, COMMIT, the attempts' accounting) are in `lua_turn`; the
delivery relay's and the rate limiter's in `lua_relay`.
"""

from __future__ import annotations

# Shared helpers, put in front of the scripts that use them.
# The session's meta as this script knows it: each field read once (`meta_reads` below reads those
# a script will want, first, in one HMGET; `mget` one it did not name), changed here (`mset`,
# `mincr`; a field set to false is removed) and written back in one HSET (and an HDEL) by `mflush`
# as the script answers (a session the script made, before anything reads the key's expiry:
# `mmade`). A script runs alone: what it read cannot change under it, so this is a command a
# field, in fewer commands.
# `reply`: the script's answer. `owns`: whether the session exists and belongs to `owner` (an
# unknown session and another owner's look the same: 'missing'). `pairs_of`: a flat
# HGETALL-style list as [key, value] pairs, in its order (a Lua table as a map loses the order).
_COMMON = """
local MC, MD = {}, {}
local function mget(f)
  local v = MC[f]
  if v == nil then
    v = redis.call('HGET', K.meta, f)
    MC[f] = v
  end
  return v
end
local function mset(f, v)  -- (a field set to what it holds is not written: an integer as the string read)
  local was = MC[f]
  MC[f] = v
  if was == v or (type(v) == 'number' and was == tostring(v) and v == math.floor(v) and math.abs(v) < 1e14) then
    return
  end
  MD[f] = true
end
local function msets(t)  -- (field -> value)
  for f, v in pairs(t) do mset(f, v) end
end
local function mincr(f, n)
  local v = (tonumber(mget(f)) or 0) + n
  mset(f, v)
  return v
end
local function mflush()
  local set, del = {}, {}
  for f in pairs(MD) do
    if MC[f] == false then del[#del + 1] = f else set[#set + 1] = f; set[#set + 1] = MC[f] end
  end
  MD = {}
  if #set > 0 then redis.call('HSET', K.meta, unpack(set)) end
  if #del > 0 then redis.call('HDEL', K.meta, unpack(del)) end
end
local meta_at = nil
local function mmade()  -- a session made by this script is in Redis before its key's expiry is read
  if MD.owner then mflush(); meta_at = nil end
end
local function meta_expiry()  -- the meta's deadline (PEXPIRETIME: ms; -1 none; -2 no meta), read once a script
  mmade()
  if meta_at == nil then meta_at = redis.call('PEXPIRETIME', K.meta) end
  return meta_at
end
local function reply(t)
  mflush()
  return cmsgpack.pack(t)
end
local function owns(owner)
  local found = mget('owner')
  return found ~= false and found == owner
end
local function pairs_of(flat)
  local t = {}
  for i = 1, #flat, 2 do t[#t + 1] = {flat[i], flat[i + 1]} end
  return t
end
local clock = nil
local function now_ms()  -- the server's time (one read a script)
  if not clock then
    local t = redis.call('TIME')
    clock = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return clock
end
local function event_window()  -- events kept by age: the window (ARGV[3], ms; 0: by count only), its slack (`_EMIT`)
  local age = tonumber(ARGV[3] or 0) or 0
  return age, math.max(1, math.floor(age / 100))
end
local function windowed(key, fields)  -- hash fields kept for the idempotency window from now (ARGV[4], ms)
  local ms = tonumber(ARGV[4] or 0)
  if not ms or ms <= 0 then return end
  for j = 1, #fields, 1000 do  -- (unpack has a limit: many fields go in slices)
    local k = math.min(j + 999, #fields)
    redis.call('HPEXPIRE', key, ms, 'FIELDS', k - j + 1, unpack(fields, j, k))
  end
end
local function remembered(mid)  -- a message id kept for the window
  windowed(K.mids, {mid})
end
"""


def meta_reads(fields: str) -> str:
    """Lua that reads `fields` (names, space-separated) of the meta into the script's copy (`MC`,
    still empty) in one HMGET: a script's first read, of all the fields it will want. A table
    constructor, so that the table is sized once (the same read by a loop over the names, a table
    growing field by field, took about 4 us more in Valkey for 20 fields)."""
    names = fields.split()
    made = ", ".join(f"['{f}'] = g[{n}]" for n, f in enumerate(names, start=1))  # (any name: no Lua keyword)
    listed = ", ".join(f"'{f}'" for f in names)
    return f"do\n  local g = redis.call('HMGET', K.meta, {listed})\n  MC = {{{made}}}\nend\n"


# `emit` appends one event; `first_seq` is the seq of the first event this script emitted (the
# ones after it are consecutive), returned so the caller can build the envelopes it committed.
# A script that emitted publishes the newest event's id on the session's channel as it answers
# ("@<id>", sharded pub/sub in the session's slot: `live`), so readers in other processes hear
# of the commit at once, and a crash after the commit cannot lose the notice. Only if someone
# hears it: ARGV[2] is the writing process's origin, and a process with readers of the session
# is named in its `readers` hash until a deadline (server time, ms); the writer's own readers
# get its events from it, not from Redis. ARGV[2] 'quiet': the notice is sent after the
# replicas' WAIT instead; none (or a script that does not name `readers`): always.
# A script that emitted trims the outbox of events older than ARGV[3] ms (0: kept by count
# only; approximately: whole stream nodes) and has the stream expire that long after its newest
# event (or with the session, if sooner): a session left alone keeps no events past the window.
# It does so at most every hundredth of the window (`ob_due` in the meta: a busy session pays
# for it once in a while, not every script), so the stream's expiry is set a hundredth beyond
# the window: never before its newest event is that old, at most a hundredth after.
# `body` is the stored tail of an envelope (harness.events.event_body), for the events whose
# turn id only the script knows.
_EMIT = """
local first_seq = 0
local last_seq = 0
local last_id = false
local function emit(retention, etype, body)
  local seq = mincr('seq', 1)
  if first_seq == 0 then first_seq = seq end
  last_seq = seq
  last_id = redis.call('XADD', K.outbox, 'MAXLEN', '~', retention, '*', 's', seq, 't', etype, 'b', body)
  return last_id
end
local function heard()
  local me = ARGV[2]
  if me == 'quiet' then return false end
  if not me or not K.readers then return true end
  local r = redis.call('HGETALL', K.readers)
  for i = 1, #r, 2 do
    if r[i] ~= me and tonumber(r[i + 1]) > now_ms() then return true end
  end
  return false
end
local plain_reply = reply
reply = function(t)
  mmade()
  if last_id then
    local age, slack = event_window()
    local now = age > 0 and now_ms()
    if now and now >= (tonumber(mget('ob_due')) or 0) then
      redis.call('XTRIM', K.outbox, 'MINID', '~', now - age)
      local at = meta_expiry()
      local left = at > 0 and at - now or -1
      redis.call('PEXPIRE', K.outbox, (left > 0 and left < age + slack) and left or age + slack)
      mset('ob_due', now + slack)
    end
    if heard() then redis.call('SPUBLISH', string.sub(K.meta, 1, -5) .. 'live', '@' .. last_id) end
  end
  return plain_reply(t)
end
local function body(turn_id, at, data_json)
  return '"turn_id":' .. cjson.encode(turn_id) .. ',"at":' .. at .. ',"data":' .. data_json .. '}'
end
"""

# The session's expiry: every key of a session but its lease and its readers (which have their
# own), and its outbox when events are kept by age (see `_EMIT`: until its newest event is that
# old, at most), expires at the same moment. `keep`, in a script that names every key of the
# session (CREATE, SUBMIT, a COMMIT that ends or pauses a turn), sets them all to expire
# `ttl_ms` from now (0: never);
# within one script the server's clock stands still, so they get the very same deadline. It
# does so at most every hundredth of the TTL (an hour at most): a deadline fresher than that is
# left as it is (so a busy session costs one PTTL a script, not a PEXPIRE per key).
# `expire_with_meta` gives a key a script may have just made (a first approval request, a first
# answer, ...) the deadline its meta has, without naming the others; every script calls it for
# the keys it may have made, whether `keep` runs or not (`expire_new` for a key it knows it made:
# nothing to do if the meta has no deadline). The meta's deadline is read once a script.
_KEEP = """
local function keep_events(ttl_ms)  -- the outbox: until its newest event is the window old (see `_EMIT`)
  local newest = redis.call('XREVRANGE', K.outbox, '+', '-', 'COUNT', 1)[1]
  if not newest then return end
  local age, slack = event_window()
  local at = tonumber(string.match(newest[1], '^(%d+)')) + age + slack
  if ttl_ms > 0 then at = math.min(at, now_ms() + ttl_ms) end
  redis.call('PEXPIREAT', K.outbox, at)
end
local function keep(ttl_ms)
  local at = meta_expiry()
  local left = at > 0 and math.max(at - now_ms(), 0) or at  -- (as PTTL says it)
  if ttl_ms > 0 and left > ttl_ms - math.min(ttl_ms / 100, 3600000) then return end
  if ttl_ms <= 0 and left == -1 then return end
  meta_at = nil  -- (set anew below: read again if a key wants it after)
  local by_age = event_window() > 0
  for name, key in pairs(K) do
    if name == 'outbox' and by_age then
      keep_events(ttl_ms)
    elseif name ~= 'lease' and name ~= 'readers' then
      if ttl_ms > 0 then redis.call('PEXPIRE', key, ttl_ms) else redis.call('PERSIST', key) end
    end
  end
end
local function expire_with_meta(key)
  local at = meta_expiry()
  if at > 0 then redis.call('PEXPIREAT', key, at) elseif at == -1 then redis.call('PERSIST', key) end
end
local function expire_new(key)  -- a key this script made: it has no expiry yet
  local at = meta_expiry()
  if at > 0 then redis.call('PEXPIREAT', key, at) end
end
"""

# A new session's meta and its session.created event (shared with SUBMIT, which may create the
# session its message is for).
_CREATE = """
local function create_session(C)
  local fields = {owner = C.owner, created_at = C.created_at, updated_at = C.created_at, metadata = C.metadata,
    status = 'idle', seq = 0, fence = 0, turn = '', turn_start = 0, hist_start = 0, waiting_on = '', undecided = 0,
    cancel = ''}
  msets(fields)
  return emit(C.retention, EV.SessionCreated, C.body)
end
"""

CREATE = (
    _COMMON
    + _EMIT
    + _KEEP
    + _CREATE
    + """
if mget('owner') then return reply({tag = 'exists'}) end
local id = create_session(A)
keep(A.ttl_ms)
return reply({tag = 'ok', id = id, seq = first_seq})
"""
)

# Queues a compact or clear behind the turns before it.
ENQUEUE = (
    _COMMON
    + _KEEP
    + """
if not owns(A.owner) then return reply({tag = 'missing'}) end
if A.max_queued > 0 and redis.call('LLEN', K.inbox) > A.max_queued then return reply({tag = 'full'}) end
redis.call('RPUSH', K.inbox, A.entry)
expire_with_meta(K.inbox)
if mget('status') == 'idle' then mset('status', 'running') end
return reply({tag = 'ok'})
"""
)

# An answer to an approval request: recorded once; the turn becomes runnable when its last
# request is answered.
RESPOND = (
    _COMMON
    + _EMIT
    + _KEEP
    + meta_reads("owner cancel waiting_on undecided status seq")
    + """
if not owns(A.owner) then return reply({tag = 'missing'}) end
local request = redis.call('HGET', K.pending, A.request_id)
if not request then return reply({tag = 'unknown'}) end
local prev = redis.call('HGET', K.decisions, A.request_id)
if prev then return reply({tag = 'answered', answer = prev}) end
local turn_id = cjson.decode(request).turn_id
if mget('cancel') == turn_id then
  return reply({tag = 'answered', answer = '{"decision":"withdrawn"}'})
end
redis.call('HSET', K.decisions, A.request_id, A.answer)
expire_with_meta(K.decisions)
local resolved = body(turn_id, A.now, A.data)
local id = emit(A.retention, EV.InputResolved, resolved)
if A.message_id ~= '' and redis.call('HSETNX', K.mids, A.message_id, turn_id .. ' ' .. id) == 1 then
  expire_with_meta(K.mids)  -- (the channel's message that answered, redelivered: the same message)
  remembered(A.message_id)
end
local left = -1
local waiting_on = ' ' .. (mget('waiting_on') or '') .. ' '
if string.find(waiting_on, ' ' .. A.request_id .. ' ', 1, true) then
  left = mincr('undecided', -1)
  if left <= 0 and mget('status') == 'waiting' then mset('status', 'running') end
end
return reply({tag = 'ok', id = id, seq = first_seq, body = resolved, left = left})
"""
)

# Asks the turn in progress (or, if none began yet, the next queued message's turn) to end;
# with a turn id, only that turn. With `A.once` (a channel's id of the request, kept with the
# message ids under `!<once>`), a repeat of the same request changes nothing: a redelivered "stop" cannot end a
# later turn. The runner that holds (or next takes) the session finishes it.
# The current turn is the inbox head; a compact or clear there is not cancelled.
CANCEL = (
    _COMMON
    + _KEEP
    + """
if not owns(A.owner) then return reply({tag = 'missing'}) end
if A.once ~= '' then
  -- ('!' is in no message id: a request's id can never pass for a message's, nor the reverse)
  if redis.call('HSETNX', K.mids, '!' .. A.once, 'cancel') == 0 then return reply({tag = 'idle'}) end
  expire_with_meta(K.mids)
  remembered('!' .. A.once)
end
local head = redis.call('LINDEX', K.inbox, 0)
if not head then return reply({tag = 'idle'}) end
local m = cjson.decode(head)
if m.kind and m.kind ~= 'message' then return reply({tag = 'idle'}) end
if A.turn_id ~= '' and A.turn_id ~= m.turn_id then return reply({tag = 'idle'}) end
mset('cancel', m.turn_id)
return reply({tag = 'ok', turn_id = m.turn_id})
"""
)

# Extends the lease only for its owner.
RENEW = (
    _COMMON
    + """
if redis.call('GET', K.lease) ~= A.fence then return reply({held = false}) end
return reply({held = redis.call('PEXPIRE', K.lease, A.ttl_ms) == 1})
"""
)

# Gives the lease up only for its owner: the turn in progress, if any, is no longer held (a
# runner that hands it over to another when its process drains; the next BEGIN resumes it as
# given, not as taken over from a lapsed lease). The lease has a deadline of its own and may
# outlive its session: of a session that is no more, only the lease goes.
RELEASE = (
    _COMMON
    + """
if redis.call('GET', K.lease) ~= A.fence then return reply({held = false}) end
redis.call('DEL', K.lease)
if mget('owner') then mset('held', 0) end
return reply({held = true})
"""
)

# A page of the active history, read at one moment: from index `A.at` of the history (counted
# from its first item ever; -1: from the active history's start, `A.offset` items on), at most
# `A.limit` items (0: all), with where the active history starts; 'replaced' when `A.at` is
# before that (a compaction or a clear replaced those items since). Writes nothing.
HISTORY = (
    _COMMON
    + meta_reads("owner hist_start hist_base")
    + """
if not owns(A.owner) then return reply({tag = 'missing'}) end
local start, base = tonumber(mget('hist_start') or 0), tonumber(mget('hist_base') or 0)
local from = A.at >= 0 and A.at or start + A.offset
if from < start then return reply({tag = 'replaced', start = start}) end
local last = A.limit > 0 and from - base + A.limit - 1 or -1
return reply({tag = 'ok', start = start, items = redis.call('LRANGE', K.history, from - base, last)})
"""
)

# What a fork is made from, read at one moment: the source's meta as the fork needs it, its
# active history, and where message `A.message_id` (if any) stands: its turn (from the message
# ids), and whether it still waits in the inbox. Writes nothing.
FORK_READ = (
    _COMMON
    + """
if not owns(A.owner) then return reply({tag = 'missing'}) end
local m = {mget('metadata'), mget('title'), mget('turn'), mget('turn_start'), mget('hist_start'), mget('hist_base')}
local out = {tag = 'ok', metadata = m[1], title = m[2] or '', turn = m[3] or '', turn_start = tonumber(m[4]),
  hist_start = tonumber(m[5]), items = redis.call('LRANGE', K.history, tonumber(m[5]) - tonumber(m[6] or 0), -1)}
if A.message_id ~= '' then
  local found = redis.call('HGET', K.mids, A.message_id)
  out.message_turn = found and string.match(found, '^(%S+) ') or ''
  local head = '{"message_id":' .. cjson.encode(A.message_id) .. ','
  for _, entry in ipairs(redis.call('LRANGE', K.inbox, 0, -1)) do
    if string.sub(entry, 1, #head) == head then out.queued = true end
  end
end
return reply(out)
"""
)

# A new session made from another's history (a fork): its meta as CREATE makes it, with the
# items given as its whole history (active from the first), its title and preview the source's.
# The caller read the source (in its own slot: on a cluster, another node), which is left as it is.
FORK = (
    _COMMON
    + _EMIT
    + _KEEP
    + _CREATE
    + """
if mget('owner') then return reply({tag = 'exists'}) end
local id = create_session(A.create)
local length = 0
for j = 1, #A.items, 1000 do  -- (unpack has a limit: a long history goes in slices)
  length = redis.call('RPUSH', K.history, unpack(A.items, j, math.min(j + 999, #A.items)))
end
mset('turn_start', length)
mset('preview', A.preview)
if A.title ~= '' then mset('title', A.title) end
-- the copied messages' ids are the fork's too (sent again, the same message; edited, a fork again)
for _, m in ipairs(A.mids) do
  redis.call('HSET', K.mids, m[1], m[2] .. ' ' .. id)
  remembered(m[1])
end
keep(A.create.ttl_ms)
return reply({tag = 'ok', id = id, seq = first_seq})
"""
)

# A session's title and metadata changed (PATCH): the metadata only if it is still the JSON the
# caller merged its change into (`A.expected`; else 'changed', and nothing is written).
UPDATE = (
    _COMMON
    + """
if not owns(A.owner) then return reply({tag = 'missing'}) end
if A.metadata then
  if mget('metadata') ~= A.expected then return reply({tag = 'changed'}) end
  mset('metadata', A.metadata)
end
if A.title then mset('title', A.title) end
return reply({tag = 'ok'})
"""
)

# A process has readers of the session: its origin named in `readers` for `ttl_ms` from now
# (server time), the key kept as long, or as long as the session if it expires sooner; `ttl_ms`
# 0: it has none any more. Not for a session that is no more (nothing of it is made again).
READERS = (
    _COMMON
    + """
if A.ttl_ms <= 0 then return reply({n = redis.call('HDEL', K.readers, A.origin)}) end
if redis.call('EXISTS', K.meta) == 0 then return reply({n = 0}) end
local t = redis.call('TIME')
redis.call('HSET', K.readers, A.origin, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + A.ttl_ms)
local left = redis.call('PTTL', K.meta)
redis.call('PEXPIRE', K.readers, (left > 0 and left < A.ttl_ms) and left or A.ttl_ms)
return reply({n = 1})
"""
)

# Removes every key of the session at once: its own and the delivery relay's per destination
# (the caller read `relays` and names their keys; a destination added since makes it read
# again: 'changed'). Answers the turn in progress, whose runner is then told to stop (its next
# write finds no meta and is refused).
DELETE = (
    _COMMON
    + """
if not owns(A.owner) then return reply({tag = 'missing'}) end
local named = {}
for _, d in ipairs(A.destinations) do named[d] = true end
for _, d in ipairs(redis.call('SMEMBERS', K.relays)) do
  if not named[d] then return reply({tag = 'changed'}) end
end
local turn_id = mget('turn') or ''
redis.call('UNLINK', unpack(KEYS))
return reply({tag = 'ok', turn_id = turn_id})
"""
)

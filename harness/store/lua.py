"""The atomic operations on a session, as Lua scripts. Each touches only keys of one session
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
the history list), u_in/u_out/u_cached/u_cwrite/u_calls (usage), last_in/last_est (the provider-reported
input tokens of the last turn call and keel's estimate of that request, for compaction),
waiting_on (the request ids the paused turn waits for), undecided (how many of them are
unanswered), cancel (the turn a cancel was asked for), held (1 while a runner runs the turn in
progress: a BEGIN that finds it so took the turn over from a lapsed lease).

The inbox holds user messages and, queued among them, manual compact and clear entries (`kind`);
the current turn is always the inbox head.

The delivery relay's scripts and the rate limiter's are in `lua_relay`.
"""

from __future__ import annotations

# Shared helpers, put in front of the scripts that use them.
# `reply`: the script's answer. `owns`: whether the session exists and belongs to `owner` (an
# unknown session and another owner's look the same: 'missing'). `pairs_of`: a flat
# HGETALL-style list as [key, value] pairs, in its order (a Lua table as a map loses the order).
_COMMON = """
local function reply(t) return cmsgpack.pack(t) end
local function owns(owner)
  local found = redis.call('HGET', K.meta, 'owner')
  return found ~= false and found == owner
end
local function pairs_of(flat)
  local t = {}
  for i = 1, #flat, 2 do t[#t + 1] = {flat[i], flat[i + 1]} end
  return t
end
"""

# `emit` appends one event; `first_seq` is the seq of the first event this script emitted (the
# ones after it are consecutive), returned so the caller can build the envelopes it committed.
# A script that emitted publishes the newest event's id on the session's channel as it answers
# ("@<id>", sharded pub/sub in the session's slot: `live`), so readers in other processes hear
# of the commit at once, and a crash after the commit cannot lose the notice.
# `body` is the stored tail of an envelope (harness.events.event_body), for the events whose
# turn id only the script knows.
_EMIT = """
local first_seq = 0
local last_seq = 0
local last_id = false
local function emit(retention, etype, body)
  local seq = redis.call('HINCRBY', K.meta, 'seq', 1)
  if first_seq == 0 then first_seq = seq end
  last_seq = seq
  last_id = redis.call('XADD', K.outbox, 'MAXLEN', '~', retention, '*', 's', seq, 't', etype, 'b', body)
  return last_id
end
local plain_reply = reply
reply = function(t)
  if last_id and ARGV[2] ~= 'quiet' then redis.call('SPUBLISH', string.sub(K.meta, 1, -5) .. 'live', '@' .. last_id) end
  return plain_reply(t)
end
local function body(turn_id, at, data_json)
  return '"turn_id":' .. cjson.encode(turn_id) .. ',"at":' .. at .. ',"data":' .. data_json .. '}'
end
"""

# A model attempt's tokens: counters, the provider's last report with keel's estimate of the
# same request (turn calls only, for compaction's threshold), and its usage.recorded.
_USAGE = """
local function record_usage(retention, u)
  redis.call('HINCRBY', K.meta, 'u_in', u.input_tokens)
  redis.call('HINCRBY', K.meta, 'u_out', u.output_tokens)
  redis.call('HINCRBY', K.meta, 'u_cached', u.cached_tokens)
  if u.cache_write_tokens > 0 then redis.call('HINCRBY', K.meta, 'u_cwrite', u.cache_write_tokens) end
  if u.last_est then redis.call('HSET', K.meta, 'last_in', u.input_tokens, 'last_est', u.last_est) end
  return emit(retention, 'usage.recorded', u.body)
end
"""

# A new session's meta and its session.created event (shared with SUBMIT, which may create the
# session its message is for).
_CREATE = """
local function create_session(C)
  redis.call('HSET', K.meta, 'owner', C.owner, 'created_at', C.created_at, 'metadata', C.metadata,
    'status', 'idle', 'seq', 0, 'fence', 0, 'turn', '', 'turn_start', 0, 'hist_start', 0,
    'waiting_on', '', 'undecided', 0, 'cancel', '')
  return emit(C.retention, 'session.created', C.body)
end
"""

CREATE = (
    _COMMON
    + _EMIT
    + _CREATE
    + """
if redis.call('EXISTS', K.meta) == 1 then return reply({tag = 'exists'}) end
local id = create_session(A)
return reply({tag = 'ok', id = id, seq = first_seq})
"""
)

# Queues a compact or clear behind the turns before it.
ENQUEUE = (
    _COMMON
    + """
if not owns(A.owner) then return reply({tag = 'missing'}) end
if A.max_queued > 0 and redis.call('LLEN', K.inbox) > A.max_queued then return reply({tag = 'full'}) end
redis.call('RPUSH', K.inbox, A.entry)
if redis.call('HGET', K.meta, 'status') == 'idle' then redis.call('HSET', K.meta, 'status', 'running') end
return reply({tag = 'ok'})
"""
)

# Takes the session for one turn: lease with a new fencing token, keyed context applied,
# turn.started emitted once per turn (and its first model call counted, before it is made),
# and everything the turn needs to run, in one trip. A compact entry emits compaction.requested
# instead; a clear, nothing.
# A turn paused for approval is not taken until its requests are all answered (or it is
# cancelled). History comes back from `have_start + have_len` on when the caller's cached copy
# starts at the same index and is not longer than the list; else all of the active history.
# `begin_turn` is shared with SUBMIT, which begins the turn of a message it finds alone.
_BEGIN_TURN = """
local function begin_turn(B)
  local meta = redis.call('HMGET', K.meta, 'owner', 'cancel', 'status', 'undecided', 'turn', 'hist_start',
    'turn_start', 'waiting_on', 'last_in', 'last_est', 'held')
  if not meta[1] then return {tag = 'missing'} end
  local head = redis.call('LINDEX', K.inbox, 0)
  if not head then return {tag = 'empty'} end
  local m = cjson.decode(head)
  local cancel = meta[2] == m.turn_id
  if meta[3] == 'waiting' and not cancel and tonumber(meta[4] or 0) > 0 then
    return {tag = 'waiting'}
  end
  local holder = redis.call('GET', K.lease)
  if holder and holder ~= B.fence then return {tag = 'busy', retry_ms = redis.call('PTTL', K.lease)} end
  local fence = redis.call('HINCRBY', K.meta, 'fence', 1)
  redis.call('SET', K.lease, fence, 'PX', B.lease_ms)
  -- the turn in progress was held by a runner that never paused or ended it: its lease lapsed
  local out = {tag = 'ok', fence = fence, head = head, cancel = cancel,
    took_over = meta[5] == m.turn_id and meta[11] == '1'}
  local kind = m.kind or 'message'
  local length = redis.call('LLEN', K.history)
  local turn_start = tonumber(meta[7])
  local waiting_on = meta[8] or ''
  if meta[5] ~= m.turn_id then
    if kind == 'message' and type(m.sticky) == 'table' then
      for k, v in pairs(m.sticky) do
        if v == cjson.null then redis.call('HDEL', K.sticky, k)
        elseif type(v) == 'string' then redis.call('HSET', K.sticky, k, v) end
      end
    end
    turn_start, waiting_on = length, ''
    redis.call('HSET', K.meta, 'turn', m.turn_id, 'turn_start', turn_start, 'status', 'running',
      'waiting_on', '', 'undecided', 0, 'held', 1)
    local started = nil
    if kind == 'message' then
      started = {'turn.started', '{"message_id":' .. cjson.encode(m.message_id) .. '}'}
      if not cancel then redis.call('HINCRBY', K.meta, 'u_calls', 1) end  -- the model call that comes next
    elseif kind == 'compact' then
      started = {'compaction.requested', '{"reason":"manual"}'}
    end
    if started then
      out.started_body = body(m.turn_id, B.now, started[2])
      out.started_id = emit(B.retention, started[1], out.started_body)
      out.started_seq = last_seq
    end
  else
    redis.call('HSET', K.meta, 'status', 'running', 'held', 1)
  end
  local start = tonumber(meta[6])
  local from = start
  if B.have_start == start and start + B.have_len <= length then from = start + B.have_len end
  local decisions = {}
  for rid in string.gmatch(waiting_on, '%S+') do
    decisions[#decisions + 1] = rid
    decisions[#decisions + 1] = redis.call('HGET', K.decisions, rid) or ''
  end
  out.n_before = turn_start - start
  out.start = start
  out.reused = from - start
  out.items = redis.call('LRANGE', K.history, from, -1)
  out.sticky = pairs_of(redis.call('HGETALL', K.sticky))
  out.decisions = pairs_of(decisions)
  out.last_in = tonumber(meta[9]) or 0
  out.last_est = tonumber(meta[10]) or 0
  return out
end
"""

BEGIN = _COMMON + _EMIT + _BEGIN_TURN + "return reply(begin_turn(A))\n"

# Records a message (idempotent on its message_id) with its message.received event. With
# `A.begin` (a process that runs turns, and runs none of this session's now), a message that
# is alone in the inbox, with the lease free, has its turn begun in the same script: `began`.
# With `A.create`, a session that does not exist yet is created first (a webhook channel's
# conversation whose session id follows from the conversation): `created` is its event's id.
SUBMIT = (
    _COMMON
    + _EMIT
    + _CREATE
    + _BEGIN_TURN
    + """
local created = nil
if A.create and redis.call('EXISTS', K.meta) == 0 then created = create_session(A.create) end
if not owns(A.owner) then return reply({tag = 'missing'}) end
local prev = redis.call('HGET', K.mids, A.message_id)
if prev then
  local turn_id, received_id = string.match(prev, '^(.*) (%S+)$')
  return reply({tag = 'dup', turn_id = turn_id, received_id = received_id})
end
-- (the inbox's head is the turn in progress: `max_queued` may wait behind it)
if A.max_queued > 0 and redis.call('LLEN', K.inbox) > A.max_queued then return reply({tag = 'full'}) end
local id = emit(A.retention, 'message.received', A.body)
local out = {tag = 'new', id = id, seq = last_seq, created = created}
redis.call('HSET', K.mids, A.message_id, A.turn_id .. ' ' .. id)
if redis.call('RPUSH', K.inbox, A.entry) == 1 and A.begin and redis.call('EXISTS', K.lease) == 0 then
  out.began = begin_turn(A.begin)
  return reply(out)
end
if redis.call('HGET', K.meta, 'status') == 'idle' then redis.call('HSET', K.meta, 'status', 'running') end
return reply(out)
"""
)

# One step's results and events, guarded by the fencing token. Modes: 'step'; 'final', the end
# of the turn (the message leaves the inbox; the lease is released if the inbox is empty, else
# kept for the next turn); 'pause' for approval (requests stored, status waiting, lease
# released). Any mode reports whether a cancel was asked for this turn ('pause' then does not
# pause). Answers the harness gives itself (withdrawn requests of a cancelled turn) never
# replace one already recorded; each one that is set emits its input.resolved.
# With `attempt` the model call that follows this commit is counted (unless a cancel is pending).
# A rebase (compaction, clear) makes the appended items the whole active history: it begins at
# the first of them, and the current turn's items at `rebase` of them; the provider's last
# token report no longer describes the context, so it is forgotten.
# A model step's tokens (`usage`) are recorded first, before the fence is checked: the
# attempt happened whoever owns the session now, and a refused commit still leaves them (I5).
# A turn's events never say something happened that did not (a cancel may be accepted at any
# time): with `guard`, a commit that finds a cancel pending writes nothing but the usage
# ('dropped'); `announce` (the next tool call's tool.started) is written only if none is pending.
COMMIT = (
    _COMMON
    + _EMIT
    + _USAGE
    + """
local ids = {}
if A.usage then ids[1] = record_usage(A.retention, A.usage) end
local state = redis.call('HMGET', K.meta, 'turn', 'cancel')
if redis.call('GET', K.lease) ~= A.fence or state[1] ~= A.turn_id then
  return reply({tag = 'stale'})
end
local cancel = state[2] == A.turn_id
if A.guard and cancel then  -- what it would announce will not happen: the usage only
  return reply({tag = 'dropped', ids = ids, length = 0, cancel = true, first_seq = first_seq, resolved = {}})
end
local before = redis.call('LLEN', K.history)
local length = before
for j = 1, #A.items, 1000 do  -- (unpack has a limit: a long rebase goes in slices)
  length = redis.call('RPUSH', K.history, unpack(A.items, j, math.min(j + 999, #A.items)))
end
if A.rebase then
  redis.call('HSET', K.meta, 'hist_start', before, 'turn_start', before + A.rebase, 'last_in', 0, 'last_est', 0)
end
for _, r in ipairs(A.requests) do redis.call('HSET', K.pending, r.request_id, r.json) end
local resolved = {}  -- which of the given answers were set (and emitted), 0-based
for j, a in ipairs(A.answers) do
  if redis.call('HSETNX', K.decisions, a.request_id, a.json) == 1 then
    ids[#ids + 1] = emit(A.retention, 'input.resolved', a.body)
    resolved[#resolved + 1] = j - 1
  end
end
for _, e in ipairs(A.events) do ids[#ids + 1] = emit(A.retention, e.type, e.body) end
if not cancel then
  for _, e in ipairs(A.announce) do ids[#ids + 1] = emit(A.retention, e.type, e.body) end
end
if A.attempt and not cancel then redis.call('HINCRBY', K.meta, 'u_calls', 1) end
local out = {tag = 'ok', ids = ids, length = length, cancel = cancel, first_seq = first_seq, resolved = resolved}
if A.mode == 'pause' then
  redis.call('HSET', K.meta, 'waiting_on', table.concat(A.waiting_on, ' '), 'undecided', #A.waiting_on)
  if not cancel then
    redis.call('HSET', K.meta, 'status', 'waiting', 'held', 0)
    redis.call('DEL', K.lease)
    out.tag = 'paused'
  end
elseif A.mode == 'final' then
  redis.call('LPOP', K.inbox)
  local left = redis.call('LLEN', K.inbox)
  redis.call('HSET', K.meta, 'turn', '', 'status', left > 0 and 'running' or 'idle', 'waiting_on', '', 'undecided', 0,
    'held', 0)
  if cancel then redis.call('HSET', K.meta, 'cancel', '') end
  out.cancel = false
  out.tag = 'more'
  if left == 0 then redis.call('DEL', K.lease); out.tag = 'done' end
end
return reply(out)
"""
)

# Provider attempts are counted (u_calls) before they are made, by the write that precedes them
# (BEGIN, a commit with attempt, or ATTEMPT), so one whose reply dies with the process still
# counts. Their tokens are recorded by the commit of their step (COMMIT's `usage`), or here for
# an attempt that failed or one no commit follows (compaction's summary call): not fenced,
# since the attempt happened whoever owns the session now.
USAGE = (
    _COMMON + _EMIT + _USAGE + "return reply({tag = 'ok', id = record_usage(A.retention, A.usage), seq = first_seq})\n"
)

# Counts a model call about to be made (when no other write precedes it).
ATTEMPT = _COMMON + "return reply({n = redis.call('HINCRBY', K.meta, 'u_calls', 1)})\n"

# An answer to an approval request: recorded once; the turn becomes runnable when its last
# request is answered.
RESPOND = (
    _COMMON
    + _EMIT
    + """
if not owns(A.owner) then return reply({tag = 'missing'}) end
local request = redis.call('HGET', K.pending, A.request_id)
if not request then return reply({tag = 'unknown'}) end
local prev = redis.call('HGET', K.decisions, A.request_id)
if prev then return reply({tag = 'answered', answer = prev}) end
local turn_id = cjson.decode(request).turn_id
if redis.call('HGET', K.meta, 'cancel') == turn_id then
  return reply({tag = 'answered', answer = '{"decision":"withdrawn"}'})
end
redis.call('HSET', K.decisions, A.request_id, A.answer)
local resolved = body(turn_id, A.now, A.data)
local id = emit(A.retention, 'input.resolved', resolved)
local left = -1
local waiting_on = ' ' .. (redis.call('HGET', K.meta, 'waiting_on') or '') .. ' '
if string.find(waiting_on, ' ' .. A.request_id .. ' ', 1, true) then
  left = redis.call('HINCRBY', K.meta, 'undecided', -1)
  if left <= 0 and redis.call('HGET', K.meta, 'status') == 'waiting' then
    redis.call('HSET', K.meta, 'status', 'running')
  end
end
return reply({tag = 'ok', id = id, seq = first_seq, body = resolved, left = left})
"""
)

# Asks the turn in progress (or, if none began yet, the next queued message's turn) to end;
# with a turn id, only that turn. With `A.once` (a channel's id of the request, kept with the
# message ids), a repeat of the same request changes nothing: a redelivered "stop" cannot end a
# later turn. The runner that holds (or next takes) the session finishes it.
# The current turn is the inbox head; a compact or clear there is not cancelled.
CANCEL = (
    _COMMON
    + """
if not owns(A.owner) then return reply({tag = 'missing'}) end
if A.once ~= '' and redis.call('HSETNX', K.mids, A.once, 'cancel') == 0 then return reply({tag = 'idle'}) end
local head = redis.call('LINDEX', K.inbox, 0)
if not head then return reply({tag = 'idle'}) end
local m = cjson.decode(head)
if m.kind and m.kind ~= 'message' then return reply({tag = 'idle'}) end
if A.turn_id ~= '' and A.turn_id ~= m.turn_id then return reply({tag = 'idle'}) end
redis.call('HSET', K.meta, 'cancel', m.turn_id)
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
# given, not as taken over from a lapsed lease).
RELEASE = (
    _COMMON
    + """
if redis.call('GET', K.lease) ~= A.fence then return reply({held = false}) end
redis.call('DEL', K.lease)
redis.call('HSET', K.meta, 'held', 0)
return reply({held = true})
"""
)

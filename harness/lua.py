"""The atomic operations on a session, as Lua scripts. Each touches only keys of one session
(one hash tag, so one cluster slot) and is the only way the harness changes that session.

Events are stored as stream fields `s` (seq), `t` (type) and `b` (the envelope's JSON after
`session_id`: `"turn_id":...,"at":...,"data":...}`); readers add `id`, `seq`, `type` and
`session_id` in front, so a redelivered event is byte-identical to its first delivery. Stored
JSON from Python is never decoded and re-encoded here (cjson would change numbers).

Meta fields: owner, created_at, metadata, status (idle|running|waiting), seq, fence, turn (the
turn in progress), turn_start, hist_start (where the turn's items and the active history begin in
the history list), u_in/u_out/u_cached/u_calls (usage), last_in/last_est (the provider-reported
input tokens of the last turn call and keel's estimate of that request, for compaction),
waiting_on (the request ids the paused turn waits for), undecided (how many of them are
unanswered), cancel (the turn a cancel was asked for).

The inbox holds user messages and, queued among them, manual compact and clear entries (`kind`);
the current turn is always the inbox head.
"""

from __future__ import annotations

# Shared helpers, prepended to the scripts that use them. `owns`: whether the session exists
# and belongs to `owner` (an unknown session and another owner's look the same: 'missing').
_OWNS = """
local function owns(meta, owner)
  local found = redis.call('HGET', meta, 'owner')
  return found ~= false and found == owner
end
"""

# `emit` appends one event; `first_seq` is the seq of the first event this script emitted (the
# ones after it are consecutive), returned so the caller can build the envelopes it committed.
_EMIT = """
local first_seq = 0
local last_seq = 0
local function emit(meta, outbox, retention, etype, body)
  local seq = redis.call('HINCRBY', meta, 'seq', 1)
  if first_seq == 0 then first_seq = seq end
  last_seq = seq
  return redis.call('XADD', outbox, 'MAXLEN', '~', retention, '*', 's', seq, 't', etype, 'b', body)
end
"""

# KEYS: meta, outbox. ARGV: owner, created_at, metadata_json, retention, event_body
CREATE = (
    _EMIT
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'created_at', ARGV[2], 'metadata', ARGV[3],
  'status', 'idle', 'seq', 0, 'fence', 0, 'turn', '', 'turn_start', 0, 'hist_start', 0,
  'waiting_on', '', 'undecided', 0, 'cancel', '')
local id = emit(KEYS[1], KEYS[2], ARGV[4], 'session.created', ARGV[5])
return {'ok', id, first_seq}
"""
)


# Queues a compact or clear behind the turns before it. KEYS: meta, inbox. ARGV: owner, entry_json
ENQUEUE = (
    _OWNS
    + """
if not owns(KEYS[1], ARGV[1]) then return {'missing'} end
redis.call('RPUSH', KEYS[2], ARGV[2])
if redis.call('HGET', KEYS[1], 'status') == 'idle' then redis.call('HSET', KEYS[1], 'status', 'running') end
return {'ok'}
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
# KEYS (K): meta, inbox, lease, history, sticky, outbox, decisions.
# ARGV (A): current_fence (this runner's token, or ''), lease_ttl_ms, now, retention, have_start, have_len
_BEGIN_TURN = """
local function begin_turn(K, A)
  local meta = redis.call('HMGET', K[1], 'owner', 'cancel', 'status', 'undecided', 'turn', 'hist_start',
    'turn_start', 'waiting_on', 'last_in', 'last_est')
  if not meta[1] then return {'missing'} end
  local head = redis.call('LINDEX', K[2], 0)
  if not head then return {'empty'} end
  local m = cjson.decode(head)
  local cancel = meta[2] == m.turn_id
  if meta[3] == 'waiting' and not cancel and tonumber(meta[4] or 0) > 0 then
    return {'waiting'}
  end
  local holder = redis.call('GET', K[3])
  if holder and holder ~= A[1] then return {'busy', redis.call('PTTL', K[3])} end
  local fence = redis.call('HINCRBY', K[1], 'fence', 1)
  redis.call('SET', K[3], fence, 'PX', A[2])
  local started = ''
  local started_body = ''
  local started_seq = 0
  local kind = m.kind or 'message'
  local length = redis.call('LLEN', K[4])
  local turn_start = tonumber(meta[7])
  local waiting_on = meta[8] or ''
  if meta[5] ~= m.turn_id then
    if kind == 'message' and type(m.sticky) == 'table' then
      for k, v in pairs(m.sticky) do
        if v == cjson.null then redis.call('HDEL', K[5], k)
        elseif type(v) == 'string' then redis.call('HSET', K[5], k, v) end
      end
    end
    turn_start, waiting_on = length, ''
    redis.call('HSET', K[1], 'turn', m.turn_id, 'turn_start', turn_start, 'status', 'running',
      'waiting_on', '', 'undecided', 0)
    local env = '"turn_id":"' .. m.turn_id .. '","at":' .. A[3] .. ',"data":'
    if kind == 'message' then
      started_body = env .. '{"message_id":' .. cjson.encode(m.message_id) .. '}}'
      started = emit(K[1], K[6], A[4], 'turn.started', started_body)
      started_seq = last_seq
      if not cancel then redis.call('HINCRBY', K[1], 'u_calls', 1) end  -- the model call that comes next
    elseif kind == 'compact' then
      started_body = env .. '{"reason":"manual"}}'
      started = emit(K[1], K[6], A[4], 'compaction.requested', started_body)
      started_seq = last_seq
    end
  else
    redis.call('HSET', K[1], 'status', 'running')
  end
  local start = tonumber(meta[6])
  local from = start
  local have = tonumber(A[6])
  if tonumber(A[5]) == start and start + have <= length then from = start + have end
  local decisions = {}
  for rid in string.gmatch(waiting_on, '%S+') do
    decisions[#decisions + 1] = rid
    decisions[#decisions + 1] = redis.call('HGET', K[7], rid) or ''
  end
  return {'ok', fence, head, turn_start - start, redis.call('HGETALL', K[5]),
    redis.call('LRANGE', K[4], from, -1), start, from - start, started, cancel and '1' or '', decisions,
    {meta[9], meta[10]}, started_seq, started_body}
end
"""

BEGIN = _EMIT + _BEGIN_TURN + "return begin_turn(KEYS, ARGV)\n"

# KEYS: meta, inbox, mids, outbox, lease, history, sticky, decisions.
# ARGV: owner, message_id, turn_id, inbox_json_tail (the encoded InboxMessage without its
#       opening brace), retention, event_body, then, to begin the turn at once: begin ('1' or
#       ''), lease_ttl_ms, now, have_start, have_len.
# With begin='1' (a process that runs turns, and runs none of this session's now), a message
# that is alone in the inbox, with the lease free, has its turn begun in the same script:
# {'new', id, seq, <what BEGIN returns>}. Otherwise {'new', id, seq} and BEGIN follows.
SUBMIT = (
    _OWNS
    + _EMIT
    + _BEGIN_TURN
    + """
if not owns(KEYS[1], ARGV[1]) then return {'missing'} end
local prev = redis.call('HGET', KEYS[3], ARGV[2])
if prev then return {'dup', prev} end
local id = emit(KEYS[1], KEYS[4], ARGV[5], 'message.received', ARGV[6])
local seq = last_seq
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3] .. ' ' .. id)
if redis.call('RPUSH', KEYS[2], '{"received_id":"' .. id .. '",' .. ARGV[4]) == 1 and ARGV[7] == '1'
   and redis.call('EXISTS', KEYS[5]) == 0 then
  local began = begin_turn({KEYS[1], KEYS[2], KEYS[5], KEYS[6], KEYS[7], KEYS[4], KEYS[8]},
    {'', ARGV[8], ARGV[9], ARGV[5], ARGV[10], ARGV[11]})
  return {'new', id, seq, began}
end
if redis.call('HGET', KEYS[1], 'status') == 'idle' then redis.call('HSET', KEYS[1], 'status', 'running') end
return {'new', id, seq}
"""
)

# One step's results and events, guarded by the fencing token. Modes: '0' a step; '1' the end of
# the turn (the message leaves the inbox; the lease is released if the inbox is empty, else
# kept for the next turn); '2' a pause for approval (requests stored, status waiting, lease
# released). Any mode reports whether a cancel was asked for this turn ('2' then does not pause).
# Answers the harness gives itself (withdrawn requests of a cancelled turn) never replace one
# already recorded; each one that is set emits its input.resolved.
# With attempt=1 the model call that follows this commit is counted (unless a cancel is pending).
# A rebase (compaction, clear) makes the appended items the whole active history: it begins at
# the first of them, and the current turn's items at `rebase` of them; the provider's last
# token report no longer describes the context, so it is forgotten.
# A model step's tokens (`usage` '1') are recorded first, before the fence is checked: the
# attempt happened whoever owns the session now, and a refused commit still leaves them (I5).
# KEYS: meta, lease, history, outbox, inbox, pending, decisions.
# ARGV: fence, turn_id, retention, mode, waiting_on, attempt, rebase ('' or the offset),
#       usage ('1' or ''), u_in, u_out, u_cached, usage_body, last_est ('' to keep), n_items, items..., n_requests,
#       (request_id, json)..., n_answers, (request_id, json, event_body)..., then (type, body) pairs
COMMIT = (
    _EMIT
    + """
local ids = {}
if ARGV[8] == '1' then
  redis.call('HINCRBY', KEYS[1], 'u_in', ARGV[9])
  redis.call('HINCRBY', KEYS[1], 'u_out', ARGV[10])
  redis.call('HINCRBY', KEYS[1], 'u_cached', ARGV[11])
  if ARGV[13] ~= '' then redis.call('HSET', KEYS[1], 'last_in', ARGV[9], 'last_est', ARGV[13]) end
  ids[1] = emit(KEYS[1], KEYS[4], ARGV[3], 'usage.recorded', ARGV[12])
end
local state = redis.call('HMGET', KEYS[1], 'turn', 'cancel')
if redis.call('GET', KEYS[2]) ~= ARGV[1] or state[1] ~= ARGV[2] then
  return {'stale'}
end
local i = 14
local n = tonumber(ARGV[i])
local before = redis.call('LLEN', KEYS[3])
local length = before
if n > 0 then length = redis.call('RPUSH', KEYS[3], unpack(ARGV, i + 1, i + n)) end
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[1], 'hist_start', before, 'turn_start', before + tonumber(ARGV[7]),
    'last_in', 0, 'last_est', 0)
end
i = i + n + 1
n = tonumber(ARGV[i])
for j = i + 1, i + 2 * n, 2 do redis.call('HSET', KEYS[6], ARGV[j], ARGV[j + 1]) end
i = i + 2 * n + 1
n = tonumber(ARGV[i])
local resolved = {}  -- which of the given answers were set (and emitted), 0-based
for j = i + 1, i + 3 * n, 3 do
  if redis.call('HSETNX', KEYS[7], ARGV[j], ARGV[j + 1]) == 1 then
    ids[#ids + 1] = emit(KEYS[1], KEYS[4], ARGV[3], 'input.resolved', ARGV[j + 2])
    resolved[#resolved + 1] = (j - i - 1) / 3
  end
end
i = i + 3 * n + 1
for j = i, #ARGV, 2 do
  ids[#ids + 1] = emit(KEYS[1], KEYS[4], ARGV[3], ARGV[j], ARGV[j + 1])
end
local mode = ARGV[4]
local cancel = state[2] == ARGV[2] and '1' or ''
if ARGV[6] == '1' and cancel == '' then redis.call('HINCRBY', KEYS[1], 'u_calls', 1) end
if mode == '2' then
  local count = 0
  for _ in string.gmatch(ARGV[5], '%S+') do count = count + 1 end
  redis.call('HSET', KEYS[1], 'waiting_on', ARGV[5], 'undecided', count)
  if cancel == '' then
    redis.call('HSET', KEYS[1], 'status', 'waiting')
    redis.call('DEL', KEYS[2])
    return {'paused', ids, length, cancel, first_seq, resolved}
  end
end
if mode == '1' then
  redis.call('LPOP', KEYS[5])
  local left = redis.call('LLEN', KEYS[5])
  redis.call('HSET', KEYS[1], 'turn', '', 'status', left > 0 and 'running' or 'idle', 'waiting_on', '', 'undecided', 0)
  if cancel ~= '' then redis.call('HSET', KEYS[1], 'cancel', '') end
  if left == 0 then redis.call('DEL', KEYS[2]); return {'done', ids, length, '', first_seq, resolved} end
  return {'more', ids, length, '', first_seq, resolved}
end
return {'ok', ids, length, cancel, first_seq, resolved}
"""
)

# Provider attempts are counted (u_calls) before they are made, by the write that precedes them
# (BEGIN, a commit with attempt=1, or ATTEMPT), so one whose reply dies with the process still
# counts. Its tokens are recorded in the round trip that commits its step, just before the
# commit (I5: a refused or lost commit still leaves the attempt's tokens):
# not fenced, since the attempt happened whoever owns the session now. A turn's call also leaves
# its reported input tokens and keel's estimate of the same request, for compaction's threshold.
# KEYS: meta, outbox. ARGV: retention, u_in, u_out, u_cached, event_body, last_est ('' to keep)
USAGE = (
    _EMIT
    + """
redis.call('HINCRBY', KEYS[1], 'u_in', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'u_out', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'u_cached', ARGV[4])
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'last_in', ARGV[2], 'last_est', ARGV[6]) end
local id = emit(KEYS[1], KEYS[2], ARGV[1], 'usage.recorded', ARGV[5])
return {id, first_seq}
"""
)

# KEYS: meta. Counts a model call about to be made (when no other write precedes it).
ATTEMPT = """
return redis.call('HINCRBY', KEYS[1], 'u_calls', 1)
"""

# An answer to an approval request: recorded once; the turn becomes runnable when its last
# request is answered. KEYS: meta, pending, decisions, outbox.
# ARGV: owner, request_id, answer_json, retention, now, event_data_json
RESPOND = (
    _OWNS
    + _EMIT
    + """
if not owns(KEYS[1], ARGV[1]) then return {'missing'} end
local request = redis.call('HGET', KEYS[2], ARGV[2])
if not request then return {'unknown'} end
local prev = redis.call('HGET', KEYS[3], ARGV[2])
if prev then return {'answered', prev} end
local turn_id = cjson.decode(request).turn_id
if redis.call('HGET', KEYS[1], 'cancel') == turn_id then return {'answered', '{"decision":"withdrawn"}'} end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
local turn = cjson.encode(turn_id)
local body = '"turn_id":' .. turn .. ',"at":' .. ARGV[5] .. ',"data":' .. ARGV[6] .. '}'
local id = emit(KEYS[1], KEYS[4], ARGV[4], 'input.resolved', body)
local seq = first_seq
local left = -1
if string.find(' ' .. (redis.call('HGET', KEYS[1], 'waiting_on') or '') .. ' ', ' ' .. ARGV[2] .. ' ', 1, true) then
  left = redis.call('HINCRBY', KEYS[1], 'undecided', -1)
  if left <= 0 and redis.call('HGET', KEYS[1], 'status') == 'waiting' then
    redis.call('HSET', KEYS[1], 'status', 'running')
  end
end
return {'ok', id, left, seq, body}
"""
)

# Asks the turn in progress (or, if none began yet, the next queued message's turn) to end;
# with a turn id, only that turn. The runner that holds (or next takes) the session finishes it.
# The current turn is the inbox head; a compact or clear there is not cancelled.
# KEYS: meta, inbox. ARGV: owner, turn_id ('' for whichever is current)
CANCEL = (
    _OWNS
    + """
if not owns(KEYS[1], ARGV[1]) then return {'missing'} end
local head = redis.call('LINDEX', KEYS[2], 0)
if not head then return {'idle'} end
local m = cjson.decode(head)
if m.kind and m.kind ~= 'message' then return {'idle'} end
local turn = m.turn_id
if ARGV[2] ~= '' and ARGV[2] ~= turn then return {'idle'} end
redis.call('HSET', KEYS[1], 'cancel', turn)
return {'ok', turn}
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

SCRIPTS = (CREATE, ENQUEUE, BEGIN, SUBMIT, COMMIT, USAGE, ATTEMPT, RESPOND, CANCEL, RENEW, RELEASE)

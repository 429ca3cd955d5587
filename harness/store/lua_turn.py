"""The turn's Lua scripts: SUBMIT, BEGIN, COMMIT, USAGE, ATTEMPT.

The turn's scripts: SUBMIT (a message, perhaps its session and its turn's beginning), BEGIN,
COMMIT, and the provider attempts' accounting (USAGE, ATTEMPT). Bodies as in `lua`, built on
its shared helpers; `lua`'s docstring describes the meta fields and the events' storage.
"""

from __future__ import annotations

from harness.store.lua import _COMMON, _CREATE, _EMIT, _KEEP, meta_reads

# A model attempt's tokens: counters, the provider's last report with keel's estimate of the
# same request (turn calls only, for compaction's threshold), and its usage.recorded.
_USAGE = """
local function record_usage(retention, u)
  mincr('u_in', u.input_tokens)
  mincr('u_out', u.output_tokens)
  mincr('u_cached', u.cached_tokens)
  if u.cache_write_tokens > 0 then mincr('u_cwrite', u.cache_write_tokens) end
  if u.last_est then
    mset('last_in', u.input_tokens)
    mset('last_est', u.last_est)
  end
  return emit(retention, EV.UsageRecorded, u.body)
end
"""

# Takes the session for one turn: lease with a new fencing token, keyed context applied,
# turn.started emitted once per turn (and its first model call counted, before it is made),
# and everything the turn needs to run, in one trip. A compact entry emits compaction.requested
# instead; a clear, nothing.
# A turn paused for approval is not taken until its requests are all answered (or it is
# cancelled). History comes back from `have_start + have_len` on when the caller's cached copy
# starts at the same index, is of the same session (`have_epoch`: a session deleted or expired
# and made again under the same id has another `created_at`) and is not longer than the list;
# else all of the active history. Keyed context it writes expires with the session.
# `begin_turn` is shared with SUBMIT, which begins the turn of a message it finds alone.
# A message's keyed page context (its `sticky`: key -> text, or null to remove the key) made the
# session's, expiring with it.
_STICKY = """
local function apply_sticky(sticky)
  if type(sticky) ~= 'table' then return end
  for k, v in pairs(sticky) do
    if v == cjson.null then redis.call('HDEL', K.sticky, k)
    elseif type(v) == 'string' then redis.call('HSET', K.sticky, k, v) end
  end
  expire_with_meta(K.sticky)
end
"""

_BEGIN_TURN = """
local function begin_turn(B, known_head)  -- (SUBMIT knows the head, and that the lease is free)
  if not mget('owner') then return {tag = 'missing'} end
  local head = known_head or redis.call('LINDEX', K.inbox, 0)
  if not head then return {tag = 'empty'} end
  local m = cjson.decode(head)
  local cancel = mget('cancel') == m.turn_id
  if mget('status') == 'waiting' and not cancel and tonumber(mget('undecided') or 0) > 0 then
    return {tag = 'waiting'}
  end
  local holder = not known_head and redis.call('GET', K.lease)
  if holder and holder ~= B.fence then return {tag = 'busy', retry_ms = redis.call('PTTL', K.lease)} end
  -- (the turn as it stood: changed below)
  local turn, turn_start, waiting_on = mget('turn'), tonumber(mget('turn_start')), mget('waiting_on') or ''
  local fence = mincr('fence', 1)
  redis.call('SET', K.lease, fence, 'PX', B.lease_ms)
  -- the turn in progress was held by a runner that never paused or ended it: its lease lapsed
  local out = {tag = 'ok', fence = fence, head = head, cancel = cancel,
    took_over = turn == m.turn_id and mget('held') == '1'}
  local kind = m.kind or 'message'
  local base = tonumber(mget('hist_base') or 0)  -- (items dropped from the list's head: indexes count them)
  local length = redis.call('LLEN', K.history) + base
  if turn ~= m.turn_id then
    if kind == 'message' then apply_sticky(m.sticky) end
    turn_start, waiting_on = length, ''
    msets({turn = m.turn_id, turn_start = turn_start, status = 'running', waiting_on = '', undecided = 0, held = 1,
      announced = false})
    local started = nil
    if kind == 'message' then
      started = {EV.TurnStarted, '{"message_id":' .. cjson.encode(m.message_id) .. '}'}
      if not cancel then mincr('u_calls', 1) end  -- the model call that comes next
    elseif kind == 'compact' then
      started = {EV.CompactionRequested, '{"reason":"manual"}'}
    end
    if started then
      out.started_body = body(m.turn_id, B.now, started[2])
      out.started_id = emit(B.retention, started[1], out.started_body)
      out.started_seq = last_seq
    end
  else
    mset('status', 'running')
    mset('held', 1)
    out.announced = mget('announced') or ''  -- (a resumed paused step's call, announced: not again)
  end
  local start = tonumber(mget('hist_start'))
  local from = start
  local epoch = mget('created_at')
  if B.have_start == start and B.have_epoch == epoch and start + B.have_len <= length then
    from = start + B.have_len
  end
  local decisions = {}
  for rid in string.gmatch(waiting_on, '%S+') do
    decisions[#decisions + 1] = rid
    decisions[#decisions + 1] = redis.call('HGET', K.decisions, rid) or ''
  end
  out.n_before = turn_start - start
  out.start = start
  out.reused = from - start
  out.items = redis.call('LRANGE', K.history, from - base, -1)
  out.sticky = pairs_of(redis.call('HGETALL', K.sticky))
  out.decisions = pairs_of(decisions)
  out.last_in = tonumber(mget('last_in')) or 0
  out.last_est = tonumber(mget('last_est')) or 0
  out.epoch = epoch or ''
  out.owner = mget('owner')
  return out
end
"""

# The meta's fields a turn's beginning reads (BEGIN's, and SUBMIT's with its own).
_BEGIN_FIELDS = (
    "owner cancel status undecided turn hist_start turn_start waiting_on last_in last_est held created_at hist_base"
    " fence seq u_calls ob_due announced"
)

BEGIN = _COMMON + _EMIT + _KEEP + _STICKY + _BEGIN_TURN + meta_reads(_BEGIN_FIELDS) + "return reply(begin_turn(A))\n"

# Records a message (idempotent on its message_id) with its message.received event. With
# `A.begin` (a process that runs turns, and runs none of this session's now), a message that
# is alone in the inbox, with the lease free, has its turn begun in the same script: `began`.
# With `A.create`, a session that does not exist yet is created first (a webhook channel's
# conversation whose session id follows from the conversation): `created` is its event's id.
# A new message keeps the session: every key of it expires `ttl_ms` from now (see `keep`).
SUBMIT = (
    _COMMON
    + _EMIT
    + _KEEP
    + _CREATE
    + _STICKY
    + _BEGIN_TURN
    + meta_reads(_BEGIN_FIELDS + " title interrupts")
    + """
local created = nil
if A.create and not mget('owner') then created = create_session(A.create) end
if not owns(A.owner) then return reply({tag = 'missing'}) end
local prev = redis.call('HGET', K.mids, A.message_id)
if prev then
  local turn_id, received_id = string.match(prev, '^(.*) (%S+)$')
  return reply({tag = 'dup', turn_id = turn_id, received_id = received_id})
end
-- the message's policy, if a turn runs or waits (the inbox's head: the turn in progress, or next)
local head = redis.call('LINDEX', K.inbox, 0)
local h = head and A.policy ~= 'queue' and cjson.decode(head) or nil
if h and A.policy == 'reject' then return reply({tag = 'rejected'}) end
-- (the inbox's head is the turn in progress: `max_queued` may wait behind it, steered ones
-- that no model call took yet counted too)
if head and A.max_queued > 0 and redis.call('LLEN', K.inbox) + redis.call('LLEN', K.steer) > A.max_queued then
  return reply({tag = 'full'})
end
-- the list's view of the session: its latest activity, the start of its last message, and its
-- title until one is set (the start of its first message)
mset('updated_at', A.at)
mset('preview', A.preview)
if not mget('title') then mset('title', A.title) end
-- the message id's turn and event, once and for all: with no end while its turn is to come, runs
-- or waits (a resend is the same message however long that takes); its window starts as that
-- turn ends (COMMIT's 'final')
local function known_as(turn_id, id)
  redis.call('HSET', K.mids, A.message_id, turn_id .. ' ' .. id)
  if meta_expiry() > 0 and redis.call('HLEN', K.mids) == 1 then expire_new(K.mids) end
end
local message_turn = h and (h.kind or 'message') == 'message' and h.turn_id == mget('turn')
if h and A.policy == 'steer' and message_turn and mget('status') == 'running' then
  -- joins the running turn: its next commit before a model call takes it (COMMIT)
  local steered = body(h.turn_id, A.at, A.steered)
  local id = emit(A.retention, EV.MessageSteered, steered)
  known_as(h.turn_id, id)
  if redis.call('RPUSH', K.steer, A.entry) == 1 then expire_new(K.steer) end
  keep(A.ttl_ms)
  return reply({tag = 'new', id = id, seq = last_seq, steered = h.turn_id, body = steered})
end
local id = emit(A.retention, EV.MessageReceived, A.body)
local out = {tag = 'new', id = id, seq = last_seq, created = created}
known_as(A.turn_id, id)
local queued
if h and A.policy == 'interrupt' then
  -- the turn in progress ends as a cancel ends it (a compact or clear is not cancelled), and
  -- this message runs next, right behind it
  if (h.kind or 'message') == 'message' then
    mset('cancel', h.turn_id)
    out.interrupted = h.turn_id
  end
  -- (behind the interrupts already waiting behind this head, in the order they came)
  local last = mget('interrupts')
  local pivot = head
  if last and redis.call('LPOS', K.inbox, last) then pivot = last end
  queued = redis.call('LINSERT', K.inbox, 'AFTER', pivot, A.entry)
  mset('interrupts', A.entry)
else
  queued = redis.call('RPUSH', K.inbox, A.entry)
end
if queued == 1 then expire_new(K.inbox) end
if queued == 1 and A.begin and redis.call('EXISTS', K.lease) == 0 then
  out.began = begin_turn(A.begin, A.entry)
elseif mget('status') == 'idle' then
  mset('status', 'running')
end
keep(A.ttl_ms)
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
# A session that is no more (deleted, expired) gets nothing, its usage neither: 'stale'. A commit
# that ends or pauses the turn keeps the session (every key expires `ttl_ms` from now); a step's
# first items, requests or answers expire with it.
COMMIT = (
    _COMMON
    + _EMIT
    + _KEEP
    + _USAGE
    + _STICKY
    # (with those a turn's end sets: unchanged ones are not written)
    + meta_reads(
        "owner turn cancel seq u_in u_out u_cached u_calls hist_base interrupts ob_due status held waiting_on undecided"
        " announced joined asked"
    )
    + """
if not mget('owner') then return reply({tag = 'stale'}) end
local ids = {}
if A.usage then ids[1] = record_usage(A.retention, A.usage) end
local state = {mget('turn'), mget('cancel')}
if redis.call('GET', K.lease) ~= A.fence or state[1] ~= A.turn_id then
  return reply({tag = 'stale'})
end
local cancel = state[2] == A.turn_id
if A.guard and cancel then  -- what it would announce will not happen: the usage only
  return reply({tag = 'dropped', ids = ids, length = 0, cancel = true, first_seq = first_seq, resolved = {}})
end
-- (indexes count from the history's first item ever: the list holds the active history only)
local base = tonumber(mget('hist_base') or 0)
local held = nil  -- (how many items the list held before this commit's)
for j = 1, #A.items, 1000 do  -- (unpack has a limit: a long rebase goes in slices)
  held = redis.call('RPUSH', K.history, unpack(A.items, j, math.min(j + 999, #A.items))) - math.min(j + 999, #A.items)
end
held = held or redis.call('LLEN', K.history)
local before = held + base
local length = before + #A.items
if A.rebase then
  -- the items the new active history replaces leave the list
  if held > 0 then
    redis.call('LTRIM', K.history, held, -1)
    base = base + held
  end
  local rebased = {hist_start = before, turn_start = before + A.rebase, hist_base = base, last_in = 0, last_est = 0}
  msets(rebased)
end
-- `joined` and `asked` in the meta: the ids of the messages steered into the turn and of its
-- approval requests, whose windows start as the turn ends
local function ids_of(f)
  local t = {}
  for id in string.gmatch(mget(f) or '', '%S+') do t[#t + 1] = id end
  return t
end
local function add_ids(f, t)
  if #t > 0 then mset(f, (mget(f) or '') .. ' ' .. table.concat(t, ' ')) end
end
local asked = {}
for _, r in ipairs(A.requests) do
  redis.call('HSET', K.pending, r.request_id, r.json)
  asked[#asked + 1] = r.request_id
end
add_ids('asked', asked)
local resolved = {}  -- which of the given answers were set (and emitted), 0-based
for j, a in ipairs(A.answers) do
  if redis.call('HSETNX', K.decisions, a.request_id, a.json) == 1 then
    ids[#ids + 1] = emit(A.retention, EV.InputResolved, a.body)
    resolved[#resolved + 1] = j - 1
  end
end
for _, e in ipairs(A.events) do ids[#ids + 1] = emit(A.retention, e.type, e.body) end
if not cancel then
  for _, e in ipairs(A.announce) do ids[#ids + 1] = emit(A.retention, e.type, e.body) end
end
if A.announced ~= '' then mset('announced', A.announced) end  -- (written: a guarded commit got here)
if A.attempt and not cancel then mincr('u_calls', 1) end
-- messages steered into the turn join it now, before the model call this commit precedes: as
-- user items of the turn, after what it appended (the take and the items are one write)
local steered = {}
if A.attempt and not cancel and A.mode == 'step' then
  local joined = {}
  for _, entry in ipairs(redis.call('LRANGE', K.steer, 0, -1)) do
    local m = cjson.decode(entry)
    apply_sticky(m.sticky)  -- (its keyed page context: for the turns that follow)
    joined[#joined + 1] = m.message_id
    steered[#steered + 1] = '{"id":' .. cjson.encode('it_' .. A.turn_id .. '_s_' .. m.turn_id) ..
      ',"role":"user","text":' .. cjson.encode(m.text) .. ',"turn_id":' .. cjson.encode(A.turn_id) ..
      ',"message_id":' .. cjson.encode(m.message_id) .. '}'
    length = redis.call('RPUSH', K.history, steered[#steered]) + base
  end
  if #steered > 0 then
    redis.call('DEL', K.steer)
    add_ids('joined', joined)
  end
end
local out = {tag = 'ok', ids = ids, length = length, cancel = cancel, first_seq = first_seq, resolved = resolved,
  steered = steered}
if A.mode == 'pause' then
  mset('waiting_on', table.concat(A.waiting_on, ' '))
  mset('undecided', #A.waiting_on)
  if not cancel then
    mset('status', 'waiting')
    mset('held', 0)
    redis.call('DEL', K.lease)
    out.tag = 'paused'
  end
elseif A.mode == 'final' then
  local done = redis.call('LPOP', K.inbox)
  -- the turn's message ids (its own, and those steered into it) are remembered for the window
  -- from now on (a compact's or clear's entry has no recorded id: nothing to expire)
  local ids = ids_of('joined')
  if done then  -- (an id of other characters, escaped in the entry's JSON: decoded)
    ids[#ids + 1] = string.match(done, '^{"message_id":"([%w._:%-]*)"') or cjson.decode(done).message_id
  end
  windowed(K.mids, ids)
  mset('joined', false)
  -- and so are its approval requests and their answers (a repeated answer: the same one)
  local rids = ids_of('asked')
  windowed(K.pending, rids)
  windowed(K.decisions, rids)
  mset('asked', false)
  -- messages steered into the turn that no model call took run next, in the order they came,
  -- each a turn of its own now (its message.received written last, after the commit's events)
  local waiting = redis.call('LRANGE', K.steer, 0, -1)
  out.received = {}
  for _, entry in ipairs(waiting) do
    local m = cjson.decode(entry)
    local data = '{"message_id":' .. cjson.encode(m.message_id) .. ',"text":' .. cjson.encode(m.text) .. '}'
    local received = body(m.turn_id, A.at, data)
    local rid = emit(A.retention, EV.MessageReceived, received)
    redis.call('HSET', K.mids, m.message_id, m.turn_id .. ' ' .. rid)  -- (a turn to come: no window yet)
    out.received[#out.received + 1] = {id = rid, seq = last_seq, body = received}
  end
  -- (they run first, but after the messages that interrupted the turn: those run next; an
  -- interrupt cancels the turn, so only a cancelled turn has them)
  local last = cancel and mget('interrupts')
  local pivot = last and redis.call('LPOS', K.inbox, last) and last or nil
  for j = 1, #waiting do
    if pivot then
      redis.call('LINSERT', K.inbox, 'AFTER', pivot, waiting[j])
      pivot = waiting[j]
    else
      redis.call('LPUSH', K.inbox, waiting[#waiting - j + 1])
    end
  end
  if #waiting > 0 then
    redis.call('DEL', K.steer)
    expire_with_meta(K.inbox)
  end
  if last then mset('interrupts', false) end
  local left = redis.call('LLEN', K.inbox)
  local ended = {turn = '', status = left > 0 and 'running' or 'idle', waiting_on = '', undecided = 0, held = 0,
    announced = false}
  msets(ended)
  if cancel then mset('cancel', '') end
  out.cancel = false
  out.tag = 'more'
  if left == 0 then redis.call('DEL', K.lease); out.tag = 'done' end
end
if A.mode ~= 'step' and A.at ~= '' then  -- a turn's end (or pause) is activity too
  mset('updated_at', A.at)
  if A.preview ~= '' then mset('preview', A.preview) end
end
if held == 0 and length > before then expire_new(K.history) end
if #A.requests > 0 then expire_with_meta(K.pending) end
if #resolved > 0 then expire_with_meta(K.decisions) end
if A.mode ~= 'step' then keep(A.ttl_ms) end
return reply(out)
"""
)

# Provider attempts are counted (u_calls) before they are made, by the write that precedes them
# (BEGIN, a commit with attempt, or ATTEMPT), so one whose reply dies with the process still
# counts. Their tokens are recorded by the commit of their step (COMMIT's `usage`), or here for
# an attempt that failed or one no commit follows (compaction's summary call): not fenced,
# since the attempt happened whoever owns the session now; but not in a session that is no more.
USAGE = (
    _COMMON
    + _EMIT
    + _USAGE
    + meta_reads("owner seq u_in u_out u_cached")
    + """
if not mget('owner') then return reply({tag = 'stale'}) end
return reply({tag = 'ok', id = record_usage(A.retention, A.usage), seq = first_seq})
"""
)

# Counts a model call about to be made (when no other write precedes it); -1: no session.
ATTEMPT = (
    _COMMON
    + """
if not mget('owner') then return reply({n = -1}) end
return reply({n = mincr('u_calls', 1)})
"""
)

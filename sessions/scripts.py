"""The Lua scripts that move a turn through its states atomically.

Each script call touches only one session's keys (one hash slot), so they run
on Redis Cluster too; PUBLISH takes a whole engine step's turns in one call on
one Redis, and one turn per call on a cluster. The legal statuses come in as
arguments computed from ``states.TRANSITIONS``, and the events come in already
encoded by ``schema.pack``: the scripts know the meta hash's fields
(``schema.SessionMeta``) but neither the state table nor the events' format.
The few statuses and effect codes a script names itself are written ``$NAME``
and rendered from ``states.py``'s enums (``_render``), so they are declared once.

A session's keys live ``ttl`` seconds (a field of its meta, set when it is
created) after each write, whichever process writes: the TTL argument a
caller passes only stands in for a session that has none recorded. A running
turn's publishes renew it less often, to a little more (see PUBLISH).

Scripts that append to a turn's stream also SPUBLISH on the session's wake
channel (its third KEY, same slot): on a cluster the frontends' fan-in waits on
those channels, one connection per node, since one XREAD cannot span slots.
On one Redis the fan-in blocks in XREAD, and PUBLISH skips them.

Replies are flat arrays (PUBLISH's: one per turn, msgpack-encoded) whose first
element says what happened:
``ok``, ``not_found`` (no such session, or wrong token), ``illegal`` (then the
current status), ``stale`` (the session moved on to another turn), ``fenced``
(another engine now owns the turn) or ``moved`` (the counters a pre-encoded
event was computed from changed: read the meta again and retry).
"""

from __future__ import annotations

from string import Template

from wsinfer.contract import TurnStatus
from wsinfer.sessions.schema import Control
from wsinfer.sessions.states import FLAG_PREFIX, Effect

# What ``$NAME`` stands for in the scripts: $STATUS_DONE, $EFFECT_CANCEL,
# $FLAG_STOP, ... (Lua itself has no ``$``, so nothing else is touched).
_NAMES = {
    **{f"STATUS_{status.name}": status.value for status in TurnStatus},
    **{f"EFFECT_{effect.name}": effect.value for effect in Effect},
    **{f"FLAG_{flag.name}": flag.value for flag in Control if flag.value},
    "FLAG_PREFIX": FLAG_PREFIX,
}


def _render(script: str) -> str:
    """The script with its ``$NAME``s filled in; an unknown name is a KeyError
    at import, not a script that compares with a misspelt status."""
    return Template(script).substitute(_NAMES)


# Shared Lua prelude: membership test for the comma-separated status list, the
# session's TTL, the counters a pre-encoded event depends on, and ending a turn
# as cancelled (a client's stop) with such an event.
_PRELUDE = """
local function allowed(status, list)
  for s in string.gmatch(list, '[^,]+') do
    if s == status then return true end
  end
  return false
end
local function ttl_of(meta, fallback)
  return tonumber(redis.call('HGET', meta, 'ttl')) or tonumber(fallback)
end
local function counters(meta)
  local out = {}
  for _, name in ipairs({'turn', 'seq', 'prompt_tokens', 'cached_tokens'}) do
    table.insert(out, tostring(tonumber(redis.call('HGET', meta, name)) or 0))
  end
  return table.concat(out, ':')
end
-- A session is watched until seen_at: a client's touch moves it forward, never
-- back, so a background turn's later horizon (WATCH_UNTIL) outlasts its followers.
local function watched(meta, at)
  if (tonumber(redis.call('HGET', meta, 'seen_at')) or 0) < tonumber(at) then
    redis.call('HSET', meta, 'seen_at', at)
  end
end
local function cancel(meta, stream, done_event, done_status)
  redis.call('XADD', stream, '*', 'm', done_event)
  redis.call('HSET', meta, 'status', done_status, 'control', '')
end
"""

# KEYS: meta, turn_input, then every other key of the session (expiry pushed back)
# ARGV: token_hash, is_new, next_turn, mode, input, now, ttl (recorded by a new
#       session), allowed_from, target, idempotency key hash ('' for none)
# A generate repeated with the key of a turn already started (a client that
# lost the answer) starts nothing: {'repeat', turn, status} names that turn.
# Each keyed turn is one meta field, idem:<key hash> = turn, gone with the session.
START_TURN = _render(
    _PRELUDE
    + """
local meta = KEYS[1]
local function repeated()
  if ARGV[10] == '' then return nil end
  local turn = redis.call('HGET', meta, 'idem:' .. ARGV[10])
  if not turn then return nil end
  local status = '$STATUS_DONE'  -- an earlier turn has ended, or the next could not have started
  if turn == redis.call('HGET', meta, 'turn') then status = redis.call('HGET', meta, 'status') end
  return {'repeat', turn, status}
end
local exists = redis.call('EXISTS', meta) == 1
local status = '$STATUS_NEW'
if ARGV[2] == '1' then
  if exists then return repeated() or {'illegal', 'exists'} end
  redis.call('HSET', meta, 'token', ARGV[1], 'mode', ARGV[4], 'created', ARGV[6],
             'ttl', ARGV[7], 'turn', 0, 'epoch', 0, 'kv_engine', '', 'kv_len', 0)
else
  if not exists or redis.call('HGET', meta, 'token') ~= ARGV[1] then return {'not_found'} end
  local again = repeated()
  if again then return again end
  status = redis.call('HGET', meta, 'status')
end
if not allowed(status, ARGV[8]) then return {'illegal', status} end
if redis.call('HGET', meta, 'mode') ~= ARGV[4] then
  return {'mode', redis.call('HGET', meta, 'mode')}
end
if tonumber(redis.call('HGET', meta, 'turn')) + 1 ~= tonumber(ARGV[3]) then return {'stale'} end
redis.call('HSET', meta, 'turn', ARGV[3], 'status', ARGV[9], 'seq', 0, 'control', '',
           'engine', '', 'seen_at', ARGV[6], 'prompt_tokens', 0, 'cached_tokens', 0)
if ARGV[10] ~= '' then redis.call('HSET', meta, 'idem:' .. ARGV[10], ARGV[3]) end
-- When the turn started, for the OpenAI routes' ``created``: the same however
-- often, and on whichever frontend, the turn is read.
redis.call('HSET', meta, 'created:' .. ARGV[3], math.floor(tonumber(ARGV[6])))
local ttl = ttl_of(meta, ARGV[7])
redis.call('SET', KEYS[2], ARGV[5], 'EX', ttl)
redis.call('EXPIRE', meta, ttl)
for i = 3, #KEYS do redis.call('EXPIRE', KEYS[i], ttl) end
return {'ok'}
"""
)

# Client stop/pause/resume. The candidates are tried in order; the first whose
# allowed statuses include the current one is applied. A client acting on a
# session is watching it: seen_at is renewed, so a resumed turn is not taken
# for idle the moment an engine claims it. The paused and cancelled events
# come encoded from the caller, computed from the meta's counters it read.
# KEYS: meta, turn_stream, session_wake
# ARGV: token_hash, turn, ttl, now, counters, paused_event, cancelled_event, n,
#       then n times (allowed_from, target, effect)
# effects: states.Effect's values
CONTROL = _render(
    _PRELUDE
    + """
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 or redis.call('HGET', meta, 'token') ~= ARGV[1] then
  return {'not_found'}
end
if redis.call('HGET', meta, 'turn') ~= ARGV[2] then return {'stale'} end
local status = redis.call('HGET', meta, 'status')
local seq = redis.call('HGET', meta, 'seq')
for i = 0, tonumber(ARGV[8]) - 1 do
  local from, to, effect = ARGV[9 + 3 * i], ARGV[10 + 3 * i], ARGV[11 + 3 * i]
  if allowed(status, from) then
    local writes = effect == '$EFFECT_CANCEL' or effect == '$EFFECT_PAUSE'
    if writes and counters(meta) ~= ARGV[5] then return {'moved'} end
    redis.call('HSET', meta, 'status', to)
    watched(meta, ARGV[4])
    if string.sub(effect, 1, #'$FLAG_PREFIX') == '$FLAG_PREFIX' then
      redis.call('HSET', meta, 'control', string.sub(effect, #'$FLAG_PREFIX' + 1))
    elseif effect == '$EFFECT_CANCEL' then
      cancel(meta, KEYS[2], ARGV[7], to)
    elseif effect == '$EFFECT_PAUSE' then
      redis.call('XADD', KEYS[2], '*', 'm', ARGV[6])
    elseif effect == '$EFFECT_REQUEUE' then
      redis.call('HSET', meta, 'control', '')
    end
    if writes then redis.call('SPUBLISH', KEYS[3], seq) end
    local ttl = ttl_of(meta, ARGV[3])
    redis.call('EXPIRE', meta, ttl)
    redis.call('EXPIRE', KEYS[2], ttl)
    return {'ok', effect, to, seq}
  end
end
return {'illegal', status, seq}
"""
)

# Frontend: mark a followed session watched (idle pause) and push back the
# expiry of all its keys. A session closed meanwhile stays gone: a blind HSET
# would re-create its meta as a stub.
#
# And a turn left queued: the scripts that queue a turn (START_TURN, CONTROL's
# requeue, RELEASE) cannot also write the work item on a Cluster (the queue
# lives on another node), and a resume or release writes it in a second call
# anywhere, so a process that dies between the two leaves the turn queued with
# no item: no engine would ever run it. So the followed turn's queued episode
# (turn and epoch) is noted with the time it was first seen queued; once it has
# waited ``resend_after`` seconds unclaimed, the reply is 2: re-send the work
# item (and not again for another ``resend_after``, whichever frontend asks).
# A duplicate item is harmless: an engine's claim of a turn no longer queued is
# refused, and the item acked. ``resend_after`` 0: no such check.
# KEYS: meta, then every other key of the session
# ARGV: now, ttl, followed turn, the queued status, resend_after
# Returns 0 (the session is gone), 1, or 2 (re-send the turn's work item).
TOUCH = _render(
    _PRELUDE
    + """
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 then return 0 end
watched(meta, ARGV[1])
local ttl = ttl_of(meta, ARGV[2])
for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ttl) end
if tonumber(ARGV[5]) <= 0 then return 1 end
local m = redis.call('HMGET', meta, 'turn', 'status', 'epoch', 'queued_mark', 'queued_seen')
if m[1] ~= ARGV[3] or m[2] ~= ARGV[4] then
  if m[4] then redis.call('HDEL', meta, 'queued_mark', 'queued_seen') end
  return 1
end
local mark = m[1] .. ':' .. (m[3] or '')
local now = tonumber(ARGV[1])
if m[4] ~= mark then
  redis.call('HSET', meta, 'queued_mark', mark, 'queued_seen', ARGV[1])
  return 1
end
if now - tonumber(m[5]) < tonumber(ARGV[5]) then return 1 end
redis.call('HSET', meta, 'queued_seen', ARGV[1])
return 2
"""
)

# Frontend: keep the latest turn from the idle pause while nobody watches it
# (a Responses API ``background`` turn), for as long as the session's keys
# live without a write: seen_at moves to now + ttl.
# KEYS: meta
# ARGV: token_hash, turn, now, ttl (for a session that has none recorded)
WATCH_UNTIL = _render(
    _PRELUDE
    + """
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 or redis.call('HGET', meta, 'token') ~= ARGV[1] then
  return {'not_found'}
end
if redis.call('HGET', meta, 'turn') ~= ARGV[2] then return {'stale'} end
watched(meta, tonumber(ARGV[3]) + ttl_of(meta, ARGV[4]))
return {'ok'}
"""
)

# Engine: take a turn. A takeover (lease expired) bumps the epoch, which fences
# the previous engine's later publishes.
# KEYS: meta
# ARGV: engine_id, turn, now, allowed_from, target
CLAIM = _render(
    _PRELUDE
    + """
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 then return {'not_found'} end
if redis.call('HGET', meta, 'turn') ~= ARGV[2] then return {'stale'} end
local status = redis.call('HGET', meta, 'status')
if not allowed(status, ARGV[4]) then return {'illegal', status} end
redis.call('HINCRBY', meta, 'epoch', 1)
redis.call('HSET', meta, 'status', ARGV[5], 'engine', ARGV[1], 'claimed_at', ARGV[3], 'pub', 0)
local reply = {'ok'}
for _, v in ipairs(redis.call('HGETALL', meta)) do table.insert(reply, v) end
return reply
"""
)

# Engine: append one step's events for each of its turns, each fenced by its
# claim's epoch. One call carries a whole step on one Redis (a Lua call per
# delta cost the engine more than the write itself); on a cluster a call
# carries one turn, since a script's keys must share a slot.
# A stop the client asked for while the engine was pausing the turn (the engine
# decided to pause, idle or asked to, before it saw the stop flag) is applied
# here: the turn goes paused --stop--> done at once, with the cancelled done
# the engine sent along in place of the paused event, instead of the pause
# silently dropping the stop.
# The publish continues from prev_seq: a session whose seq is not that lost
# writes in a Redis failover (``gap``: the engine must rebuild the turn from
# the token log rather than leave a hole in the stream).
# The keys' expiry is pushed back on a turn's first publish of a claim, on
# its last, and otherwise at most every ttl/16 seconds (Redis's clock), to
# ttl + ttl/16: they still live at least ttl after every write, and two
# EXPIREs per delta were a quarter of the script's time.
# The turns come as one msgpack argument, not a dozen arguments each: Redis
# parsing thousands of arguments, and redis-py encoding them, cost more than
# the writes (benchmarks/bench_fanout.py). The events inside stay opaque
# strings (``schema.pack``'s bytes), written as they come.
# KEYS: per turn: meta, turn_stream, and session_wake when ARGV[3] is '1'
# ARGV: engine_id, ttl, wake ('1': SPUBLISH each turn's new seq on its wake
#       channel, which a cluster's fan-in waits on; '0' on one Redis, whose
#       fan-in blocks in XREAD), then the turns, msgpack: per turn
#       [epoch, seq, prev_seq (-1 = unchecked), final_allowed_from ('' = not
#       final), final_target, stop_allowed_from, stop_target ('' = no pending
#       stop to apply), cancelled_event, [events...], [field, value, ...]];
#       the fields include ``pub``, the engine's publish number for this
#       claim, for idempotent retries
# Reply: msgpack, one reply per turn, in order.
PUBLISH = _render(
    _PRELUDE
    + """
local engine_id, fallback_ttl = ARGV[1], tonumber(ARGV[2])
local now = tonumber(redis.call('TIME')[1])
local function publish(meta, stream, wake, t)
  -- One read of every field this decides on: a redis.call from Lua costs
  -- about as much as the work it does, and this runs for every delta.
  local m = redis.call('HMGET', meta, 'engine', 'epoch', 'pub', 'seq', 'status', 'control',
                       'seen_at', 'ttl', 'renewed_at')
  if not m[2] then return {'not_found'} end  -- every session has an epoch
  local engine, epoch, control, seen_at = m[1], tonumber(m[2]), m[6] or '', m[7] or ''
  local events, fields = t[9], t[10]
  -- A retry of a publish Redis already took (the reply was lost to an outage)
  -- is acknowledged without writing anything twice.
  local pub = nil
  for i = 1, #fields, 2 do if fields[i] == 'pub' then pub = tonumber(fields[i + 1]) end end
  if pub and epoch == t[1] and (tonumber(m[3]) or 0) >= pub then
    return {'ok', control, seen_at}
  end
  if engine ~= engine_id or epoch ~= t[1] then return {'fenced'} end
  local have = tonumber(m[4]) or 0
  if t[3] >= 0 and have ~= t[3] then return {'gap', tostring(have)} end
  local final = t[4] ~= ''
  if final and not allowed(m[5], t[4]) then return {'illegal', m[5]} end
  local stop_pending = final and t[7] ~= '' and control == '$FLAG_STOP' and allowed(t[5], t[6])
  local written = #events
  if stop_pending then written = written - 1 end  -- the paused event gives way to the done
  for i = 1, written do redis.call('XADD', stream, '*', 'm', events[i]) end
  local seq = tostring(t[2])
  local ttl = tonumber(m[8]) or fallback_ttl
  local slack = math.floor(ttl / 16)
  local renew = final or pub == nil or pub == 1 or now - (tonumber(m[9]) or 0) >= slack
  if renew then
    fields[#fields + 1] = 'renewed_at'
    fields[#fields + 1] = now
  end
  redis.call('HSET', meta, 'seq', seq, unpack(fields))
  if stop_pending then
    cancel(meta, stream, t[8], t[7])
    control = ''
  elseif final then
    redis.call('HSET', meta, 'status', t[5], 'control', '')
    control = ''
  end
  if final then redis.call('HSET', meta, 'engine', '') end
  if wake and (written > 0 or stop_pending) then redis.call('SPUBLISH', wake, seq) end
  if renew then
    redis.call('EXPIRE', meta, ttl + slack)
    redis.call('EXPIRE', stream, ttl + slack)
  end
  return {'ok', control, seen_at}
end
local turns, width = cmsgpack.unpack(ARGV[4]), 2
if ARGV[3] == '1' then width = 3 end
local replies = {}
for i, t in ipairs(turns) do
  local k = width * (i - 1)
  replies[i] = publish(KEYS[k + 1], KEYS[k + 2], width == 3 and KEYS[k + 3], t)
end
return cmsgpack.pack(replies)
"""
)

# Client: close a session. Followers on other connections must learn that the
# turn ended: an unfinished turn gets the caller's cancelled done, and its
# stream lingers briefly (the frontends' fan-ins deliver it) while every other
# key goes now.
# KEYS: meta, the latest turn's stream, then every other key of the session
# ARGV: token_hash, linger_s, counters, cancelled_event
CLOSE = _render(
    _PRELUDE
    + """
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 or redis.call('HGET', meta, 'token') ~= ARGV[1] then
  return {'not_found'}
end
local status = redis.call('HGET', meta, 'status')
if status and status ~= '$STATUS_DONE' then
  if counters(meta) ~= ARGV[3] then return {'moved'} end
  cancel(meta, KEYS[2], ARGV[4], '$STATUS_DONE')
end
for i = 3, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('DEL', meta)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return {'ok'}
"""
)

# Engine: give a running turn back (drain): queued again, no engine, so that
# any engine claims it at once from the shared queue and rebuilds it from the
# token log. Fenced like a publish: a turn taken over meanwhile is not ours.
# KEYS: meta
# ARGV: engine_id, epoch, allowed_from, target
RELEASE = _render(
    _PRELUDE
    + """
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 then return {'not_found'} end
if redis.call('HGET', meta, 'engine') ~= ARGV[1] or redis.call('HGET', meta, 'epoch') ~= ARGV[2]
then
  return {'fenced'}
end
local status = redis.call('HGET', meta, 'status')
if not allowed(status, ARGV[3]) then return {'illegal', status} end
redis.call('HSET', meta, 'status', ARGV[4], 'engine', '')
return {'ok'}
"""
)

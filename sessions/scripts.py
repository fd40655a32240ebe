"""The Lua scripts that move a turn through its states atomically.

Each script touches only one session's keys (one hash slot), so they run on
Redis Cluster too. The legal statuses come in as arguments computed from
``states.TRANSITIONS``; no script hard-codes the state machine.

Replies are flat arrays whose first element says what happened:
``ok``, ``not_found`` (no such session, or wrong token), ``illegal`` (then the
current status), ``stale`` (the session moved on to another turn) or
``fenced`` (another engine now owns the turn).
"""

from __future__ import annotations

# Shared Lua prelude: membership test for the comma-separated status list.
_PRELUDE = """
local function allowed(status, list)
  for s in string.gmatch(list, '[^,]+') do
    if s == status then return true end
  end
  return false
end
"""

# KEYS: meta, turn_input
# ARGV: token_hash, is_new, next_turn, mode, input, now, ttl, allowed_from, target
START_TURN = (
    _PRELUDE
    + """
local meta = KEYS[1]
local exists = redis.call('EXISTS', meta) == 1
local status = 'new'
if ARGV[2] == '1' then
  if exists then return {'illegal', 'exists'} end
  redis.call('HSET', meta, 'token', ARGV[1], 'mode', ARGV[4], 'created', ARGV[6],
             'turn', 0, 'epoch', 0, 'kv_engine', '', 'kv_len', 0)
else
  if not exists or redis.call('HGET', meta, 'token') ~= ARGV[1] then return {'not_found'} end
  status = redis.call('HGET', meta, 'status')
end
if not allowed(status, ARGV[8]) then return {'illegal', status} end
if redis.call('HGET', meta, 'mode') ~= ARGV[4] then
  return {'mode', redis.call('HGET', meta, 'mode')}
end
if tonumber(redis.call('HGET', meta, 'turn')) + 1 ~= tonumber(ARGV[3]) then return {'stale'} end
redis.call('HSET', meta, 'turn', ARGV[3], 'status', ARGV[9], 'seq', 0, 'control', '',
           'engine', '', 'seen_at', ARGV[6], 'prompt_tokens', 0)
redis.call('SET', KEYS[2], ARGV[5], 'EX', ARGV[7])
redis.call('EXPIRE', meta, ARGV[7])
return {'ok'}
"""
)

# Client stop/pause/resume. The candidates are tried in order; the first whose
# allowed statuses include the current one is applied.
# KEYS: meta, turn_stream
# ARGV: token_hash, turn, ttl, n, then n times (allowed_from, target, effect)
# effects: control:<value> | done_cancelled | paused | requeue
CONTROL = (
    _PRELUDE
    + """
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 or redis.call('HGET', meta, 'token') ~= ARGV[1] then
  return {'not_found'}
end
if redis.call('HGET', meta, 'turn') ~= ARGV[2] then return {'stale'} end
local status = redis.call('HGET', meta, 'status')
local seq = tonumber(redis.call('HGET', meta, 'seq'))
for i = 0, tonumber(ARGV[4]) - 1 do
  local from, to, effect = ARGV[5 + 3 * i], ARGV[6 + 3 * i], ARGV[7 + 3 * i]
  if allowed(status, from) then
    redis.call('HSET', meta, 'status', to)
    if string.sub(effect, 1, 8) == 'control:' then
      redis.call('HSET', meta, 'control', string.sub(effect, 9))
    elseif effect == 'done_cancelled' then
      local usage = {prompt_tokens = tonumber(redis.call('HGET', meta, 'prompt_tokens')),
                     completion_tokens = seq, cached_tokens = 0}
      redis.call('XADD', KEYS[2], '*', 'm', cmsgpack.pack(
        {kind = 'done', seq = seq, finish_reason = 'cancelled', usage = usage}))
      redis.call('HSET', meta, 'control', '')
    elseif effect == 'paused' then
      redis.call('XADD', KEYS[2], '*', 'm', cmsgpack.pack({kind = 'paused', seq = seq}))
    elseif effect == 'requeue' then
      redis.call('HSET', meta, 'control', '')
    end
    redis.call('EXPIRE', meta, ARGV[3])
    redis.call('EXPIRE', KEYS[2], ARGV[3])
    return {'ok', effect, to, tostring(seq)}
  end
end
return {'illegal', status, tostring(seq)}
"""
)

# Engine: take a turn. A takeover (lease expired) bumps the epoch, which fences
# the previous engine's later publishes.
# KEYS: meta
# ARGV: engine_id, turn, now, allowed_from, target
CLAIM = (
    _PRELUDE
    + """
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 then return {'not_found'} end
if redis.call('HGET', meta, 'turn') ~= ARGV[2] then return {'stale'} end
local status = redis.call('HGET', meta, 'status')
if not allowed(status, ARGV[4]) then return {'illegal', status} end
redis.call('HINCRBY', meta, 'epoch', 1)
redis.call('HSET', meta, 'status', ARGV[5], 'engine', ARGV[1], 'claimed_at', ARGV[3])
local reply = {'ok'}
for _, v in ipairs(redis.call('HGETALL', meta)) do table.insert(reply, v) end
return reply
"""
)

# Engine: append one step's events for a turn, fenced by the claim's epoch.
# KEYS: meta, turn_stream
# ARGV: engine_id, epoch, ttl, seq, final_allowed_from ('' = not final),
#       final_target, n_events, events..., then field/value pairs to set
PUBLISH = (
    _PRELUDE
    + """
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 then return {'not_found'} end
if redis.call('HGET', meta, 'engine') ~= ARGV[1] or redis.call('HGET', meta, 'epoch') ~= ARGV[2]
then
  return {'fenced'}
end
local n = tonumber(ARGV[7])
for i = 1, n do redis.call('XADD', KEYS[2], '*', 'm', ARGV[7 + i]) end
redis.call('HSET', meta, 'seq', ARGV[4])
for i = 8 + n, #ARGV, 2 do redis.call('HSET', meta, ARGV[i], ARGV[i + 1]) end
if ARGV[5] ~= '' then
  local status = redis.call('HGET', meta, 'status')
  if not allowed(status, ARGV[5]) then return {'illegal', status} end
  redis.call('HSET', meta, 'status', ARGV[6], 'engine', '', 'control', '')
end
redis.call('EXPIRE', meta, ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return {'ok', redis.call('HGET', meta, 'control'), redis.call('HGET', meta, 'seen_at')}
"""
)

"""The Lua scripts that move a turn through its states atomically.

Each script call touches only one session's keys (one hash slot), so they run
on Redis Cluster too; PUBLISH takes a whole engine step's turns in one call on
one Redis, and one turn per call on a cluster. The legal statuses come in as
arguments computed from ``states.TRANSITIONS``, and the events come in already
encoded by ``schema.pack``: the scripts know the meta hash's fields
(``schema.SessionMeta``) but neither the state table nor the events' format.
The few statuses, effect codes and reply codes a script names itself are
written ``$NAME`` and rendered from their enums (``_render``), so they are
declared once.

Each script's call is declared once, as a ``scripting.Script`` (``ClaimCall``,
...): its fields are the script's KEYS and ARGV, which the script reads only
through the locals its generated header binds (``meta``, ``token_hash``, ...).

A session's keys live ``ttl`` seconds (a field of its meta, set when it is
created) after each write, whichever process writes: the TTL argument a
caller passes only stands in for a session that has none recorded. A running
turn's publishes renew it less often, to a little more (see PUBLISH).

Scripts that append to a turn's stream also SPUBLISH on the session's wake
channel (its ``session_wake`` key, same slot): on a cluster the frontends'
fan-in waits on those channels, one connection per node, since one XREAD
cannot span slots. On one Redis the fan-in blocks in XREAD, and PUBLISH skips
them.

Replies are flat arrays (PUBLISH's: one per turn, msgpack-encoded) whose first
element is a ``Reply``: what happened.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum
from string import Template
from typing import Any

from wsinfer.contract import FinishReason, TurnStatus
from wsinfer.sessions.schema import Control
from wsinfer.sessions.scripting import Script, arg, counted, key, packed, rest_keys
from wsinfer.sessions.states import FLAG_PREFIX, Effect


class Reply(StrEnum):
    """The first element of a script's reply."""

    OK = "ok"
    NOT_FOUND = "not_found"  # no such session, or wrong token
    ILLEGAL = "illegal"  # then the current status
    STALE = "stale"  # the session moved on to another turn
    FENCED = "fenced"  # another engine now owns the turn
    # The counters a pre-encoded event was computed from changed: read the
    # meta again and retry.
    MOVED = "moved"
    GAP = "gap"  # a publish's prev_seq is not the session's seq: then that seq
    MODE = "mode"  # a start in the other mode: then the session's mode
    REPEAT = "repeat"  # an idempotency key's turn: then that turn and its status


# What ``$NAME`` stands for in the scripts: $STATUS_DONE, $EFFECT_CANCEL,
# $FLAG_STOP, $REPLY_OK, ... (Lua itself has no ``$``, so nothing else is touched).
_NAMES = {
    **{f"STATUS_{status.name}": status.value for status in TurnStatus},
    **{f"EFFECT_{effect.name}": effect.value for effect in Effect},
    **{f"FLAG_{flag.name}": flag.value for flag in Control if flag.value},
    **{f"REPLY_{reply.name}": reply.value for reply in Reply},
    **{f"FINISH_{reason.name}": reason.value for reason in FinishReason},
    "FLAG_PREFIX": FLAG_PREFIX,
}


def _render(script: str) -> str:
    """The script with its ``$NAME``s filled in; an unknown name is a KeyError
    at import, not a script that compares with a misspelt status."""
    return Template(script).substitute(_NAMES)


# Shared Lua prelude: membership test for the comma-separated status list, the
# session's TTL, the counters a pre-encoded event depends on, ending a turn as
# cancelled (a client's stop) with such an event, and the guards.
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
-- (The reason in double quotes: single-quoted names are the meta's fields.)
local function cancel(meta, stream, done_event, done_status)
  redis.call('XADD', stream, '*', 'm', done_event)
  redis.call('HSET', meta, 'status', done_status, 'control', '', 'finish', "$FINISH_CANCELLED")
end
-- The guards: each answers nil when the call may go on, else the reply that
-- refuses it, so that a script reads ``local refused = a() or b()``.
-- No session, or (given a token's hash) not the caller's: one answer, on purpose.
local function no_session(meta, token_hash)
  if redis.call('EXISTS', meta) == 0 then return {'$REPLY_NOT_FOUND'} end
  if token_hash and redis.call('HGET', meta, 'token') ~= token_hash then
    return {'$REPLY_NOT_FOUND'}
  end
  return nil
end
local function not_latest(meta, turn)
  if redis.call('HGET', meta, 'turn') ~= turn then return {'$REPLY_STALE'} end
  return nil
end
local function not_allowed(status, list)
  if not allowed(status, list) then return {'$REPLY_ILLEGAL', status} end
  return nil
end
"""

# A field named like a prelude function would be shadowed by it: the header
# comes first.
_PRELUDE_NAMES = frozenset(re.findall(r"local function (\w+)", _PRELUDE))


def _declare(spec: type[Script], body: str) -> str:
    """The script of ``spec``'s call: its header, the prelude, ``body``."""
    shadowed = {name for name, _, _ in spec._layout} & _PRELUDE_NAMES
    if shadowed:
        raise TypeError(f"{spec.__name__}: {sorted(shadowed)} are the prelude's")
    spec.LUA = _render(spec.header() + _PRELUDE + body)
    return spec.LUA


# A generate repeated with the key of a turn already started (a client that
# lost the answer) starts nothing: {'repeat', turn, status} names that turn.
# Each keyed turn is one meta field, idem:<key hash> = turn, gone with the session.
class StartTurnCall(Script):
    meta: str = key()
    turn_input: str = key()
    other_keys: Sequence[str] = rest_keys()  # their expiry is pushed back
    token_hash: str = arg()
    is_new: str = arg()  # '1': create the session
    next_turn: int = arg()
    mode: str = arg()
    packed_input: bytes = arg()
    now: float = arg()
    session_ttl: int = arg()  # recorded by a new session
    allowed_from: str = arg()
    target: str = arg()
    idem_hash: str = arg()  # the idempotency key's hash ('' for none)


START_TURN = _declare(
    StartTurnCall,
    """
local function repeated()
  if idem_hash == '' then return nil end
  local turn = redis.call('HGET', meta, 'idem:' .. idem_hash)
  if not turn then return nil end
  local status = '$STATUS_DONE'  -- an earlier turn has ended, or the next could not have started
  if turn == redis.call('HGET', meta, 'turn') then status = redis.call('HGET', meta, 'status') end
  return {'$REPLY_REPEAT', turn, status}
end
local status = '$STATUS_NEW'
if is_new == '1' then
  if redis.call('EXISTS', meta) == 1 then return repeated() or {'$REPLY_ILLEGAL', 'exists'} end
  redis.call('HSET', meta, 'token', token_hash, 'mode', mode, 'created', now,
             'ttl', session_ttl, 'turn', 0, 'epoch', 0, 'kv_engine', '', 'kv_len', 0)
else
  local refused = no_session(meta, token_hash) or repeated()
  if refused then return refused end
  status = redis.call('HGET', meta, 'status')
end
local refused = not_allowed(status, allowed_from)
if refused then return refused end
if redis.call('HGET', meta, 'mode') ~= mode then
  return {'$REPLY_MODE', redis.call('HGET', meta, 'mode')}
end
if tonumber(redis.call('HGET', meta, 'turn')) + 1 ~= tonumber(next_turn) then
  return {'$REPLY_STALE'}
end
redis.call('HSET', meta, 'turn', next_turn, 'status', target, 'seq', 0, 'control', '',
           'engine', '', 'seen_at', now, 'prompt_tokens', 0, 'cached_tokens', 0, 'finish', '')
if idem_hash ~= '' then redis.call('HSET', meta, 'idem:' .. idem_hash, next_turn) end
-- When the turn started, for the OpenAI routes' ``created``: the same however
-- often, and on whichever frontend, the turn is read.
redis.call('HSET', meta, 'created:' .. next_turn, math.floor(tonumber(now)))
local ttl = ttl_of(meta, session_ttl)
redis.call('SET', turn_input, packed_input, 'EX', ttl)
redis.call('EXPIRE', meta, ttl)
for _, other in ipairs(other_keys) do redis.call('EXPIRE', other, ttl) end
return {'$REPLY_OK'}
""",
)


# Client stop/pause/resume. The candidates are tried in order; the first whose
# allowed statuses include the current one is applied. A client acting on a
# session is watching it: seen_at is renewed, so a resumed turn is not taken
# for idle the moment an engine claims it. The paused and cancelled events
# come encoded from the caller, computed from the meta's counters it read.
class ControlCall(Script):
    meta: str = key()
    turn_stream: str = key()
    session_wake: str = key()
    token_hash: str = arg()
    turn: int = arg()
    fallback_ttl: int = arg()
    now: int = arg()
    expected_counters: str = arg()
    paused_event: bytes = arg()
    cancelled_event: bytes = arg()
    # effect: one of states.Effect's values; finished: the meta's ``finish`` the
    # turn must have ('' for any)
    candidates: Sequence[tuple[str, str, str, str]] = counted(
        "allowed_from", "target", "effect", "finished"
    )


CONTROL = _declare(
    ControlCall,
    """
local refused = no_session(meta, token_hash) or not_latest(meta, turn)
if refused then return refused end
local status = redis.call('HGET', meta, 'status')
local seq = redis.call('HGET', meta, 'seq')
for _, candidate in ipairs(candidates) do
  local to, effect = candidate.target, candidate.effect
  local finished = candidate.finished
  local ended_so = finished == '' or redis.call('HGET', meta, 'finish') == finished
  if allowed(status, candidate.allowed_from) and ended_so then
    local writes = effect == '$EFFECT_CANCEL' or effect == '$EFFECT_PAUSE'
    if writes and counters(meta) ~= expected_counters then return {'$REPLY_MOVED'} end
    redis.call('HSET', meta, 'status', to)
    watched(meta, now)
    if string.sub(effect, 1, #'$FLAG_PREFIX') == '$FLAG_PREFIX' then
      redis.call('HSET', meta, 'control', string.sub(effect, #'$FLAG_PREFIX' + 1))
    elseif effect == '$EFFECT_CANCEL' then
      cancel(meta, turn_stream, cancelled_event, to)
    elseif effect == '$EFFECT_PAUSE' then
      redis.call('XADD', turn_stream, '*', 'm', paused_event)
    elseif effect == '$EFFECT_REQUEUE' then
      redis.call('HSET', meta, 'control', '')
    end
    if writes then redis.call('SPUBLISH', session_wake, seq) end
    local ttl = ttl_of(meta, fallback_ttl)
    redis.call('EXPIRE', meta, ttl)
    redis.call('EXPIRE', turn_stream, ttl)
    return {'$REPLY_OK', effect, to, seq}
  end
end
return {'$REPLY_ILLEGAL', status, seq}
""",
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
# Returns 0 (the session is gone), 1, or 2 (re-send the turn's work item).
class TouchCall(Script):
    meta: str = key()
    other_keys: Sequence[str] = rest_keys()  # every other key of the session
    now: float = arg()
    fallback_ttl: int = arg()
    turn: int = arg()  # the followed turn
    queued_status: str = arg()
    resend_after: float = arg()


TOUCH = _declare(
    TouchCall,
    """
if no_session(meta) then return 0 end
watched(meta, now)
local ttl = ttl_of(meta, fallback_ttl)
redis.call('EXPIRE', meta, ttl)
for _, other in ipairs(other_keys) do redis.call('EXPIRE', other, ttl) end
if tonumber(resend_after) <= 0 then return 1 end
local m = redis.call('HMGET', meta, 'turn', 'status', 'epoch', 'queued_mark', 'queued_seen')
if m[1] ~= turn or m[2] ~= queued_status then
  if m[4] then redis.call('HDEL', meta, 'queued_mark', 'queued_seen') end
  return 1
end
local mark = m[1] .. ':' .. (m[3] or '')
if m[4] ~= mark then
  redis.call('HSET', meta, 'queued_mark', mark, 'queued_seen', now)
  return 1
end
if tonumber(now) - tonumber(m[5]) < tonumber(resend_after) then return 1 end
redis.call('HSET', meta, 'queued_seen', now)
return 2
""",
)


# Frontend: keep the latest turn from the idle pause while nobody watches it
# (a Responses API ``background`` turn), for as long as the session's keys
# live without a write: seen_at moves to now + ttl.
class WatchUntilCall(Script):
    meta: str = key()
    token_hash: str = arg()
    turn: int = arg()
    now: float = arg()
    fallback_ttl: int = arg()


WATCH_UNTIL = _declare(
    WatchUntilCall,
    """
local refused = no_session(meta, token_hash) or not_latest(meta, turn)
if refused then return refused end
watched(meta, tonumber(now) + ttl_of(meta, fallback_ttl))
return {'$REPLY_OK'}
""",
)


# Engine: take a turn. A takeover (lease expired) bumps the epoch, which fences
# the previous engine's later publishes.
class ClaimCall(Script):
    meta: str = key()
    engine_id: str = arg()
    turn: int = arg()
    now: int = arg()
    allowed_from: str = arg()
    target: str = arg()


CLAIM = _declare(
    ClaimCall,
    """
local refused = no_session(meta) or not_latest(meta, turn)
  or not_allowed(redis.call('HGET', meta, 'status'), allowed_from)
if refused then return refused end
redis.call('HINCRBY', meta, 'epoch', 1)
redis.call('HSET', meta, 'status', target, 'engine', engine_id, 'claimed_at', now, 'pub', 0)
local reply = {'$REPLY_OK'}
for _, v in ipairs(redis.call('HGETALL', meta)) do table.insert(reply, v) end
return reply
""",
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
# Reply: msgpack, one reply per turn, in order.
class PublishCall(Script):
    # per turn: meta, turn_stream, and session_wake when ``use_wake`` is '1'
    turn_keys: Sequence[str] = rest_keys()
    engine_id: str = arg()
    fallback_ttl: int = arg()
    # '1': SPUBLISH each turn's new seq on its wake channel, which a cluster's
    # fan-in waits on; '0' on one Redis, whose fan-in blocks in XREAD
    use_wake: str = arg()
    # per turn [epoch, seq, prev_seq (-1 = unchecked), final_allowed_from ('' =
    # not final), final_target, stop_allowed_from, stop_target ('' = no pending
    # stop to apply), cancelled_event, [events...], [field, value, ...]]; the
    # fields include ``pub``, the engine's publish number for this claim, for
    # idempotent retries
    turns: list[list[Any]] = packed()


PUBLISH = _declare(
    PublishCall,
    """
local now = tonumber(redis.call('TIME')[1])
local function publish(meta, stream, wake, t)
  -- One read of every field this decides on: a redis.call from Lua costs
  -- about as much as the work it does, and this runs for every delta.
  local m = redis.call('HMGET', meta, 'engine', 'epoch', 'pub', 'seq', 'status', 'control',
                       'seen_at', 'ttl', 'renewed_at')
  if not m[2] then return {'$REPLY_NOT_FOUND'} end  -- every session has an epoch
  local engine, epoch, control, seen_at = m[1], tonumber(m[2]), m[6] or '', m[7] or ''
  local events, fields = t[9], t[10]
  -- A retry of a publish Redis already took (the reply was lost to an outage)
  -- is acknowledged without writing anything twice.
  local pub = nil
  for i = 1, #fields, 2 do if fields[i] == 'pub' then pub = tonumber(fields[i + 1]) end end
  if pub and epoch == t[1] and (tonumber(m[3]) or 0) >= pub then
    return {'$REPLY_OK', control, seen_at}
  end
  if engine ~= engine_id or epoch ~= t[1] then return {'$REPLY_FENCED'} end
  local have = tonumber(m[4]) or 0
  if t[3] >= 0 and have ~= t[3] then return {'$REPLY_GAP', tostring(have)} end
  local final = t[4] ~= ''
  local refused = final and not_allowed(m[5], t[4])
  if refused then return refused end
  local stop_pending = final and t[7] ~= '' and control == '$FLAG_STOP' and allowed(t[5], t[6])
  local written = #events
  if stop_pending then written = written - 1 end  -- the paused event gives way to the done
  for i = 1, written do redis.call('XADD', stream, '*', 'm', events[i]) end
  local seq = tostring(t[2])
  local ttl = tonumber(m[8]) or tonumber(fallback_ttl)
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
  return {'$REPLY_OK', control, seen_at}
end
local width = 2
if use_wake == '1' then width = 3 end
local replies = {}
for i, t in ipairs(turns) do
  local k = width * (i - 1)
  replies[i] = publish(turn_keys[k + 1], turn_keys[k + 2], width == 3 and turn_keys[k + 3], t)
end
return cmsgpack.pack(replies)
""",
)


# Client: close a session. Followers on other connections must learn that the
# turn ended: an unfinished turn gets the caller's cancelled done, and its
# stream lingers briefly (the frontends' fan-ins deliver it) while every other
# key goes now.
class CloseCall(Script):
    meta: str = key()
    turn_stream: str = key()  # the latest turn's
    other_keys: Sequence[str] = rest_keys()  # every other key of the session
    token_hash: str = arg()
    linger_s: int = arg()
    expected_counters: str = arg()
    cancelled_event: bytes = arg()


CLOSE = _declare(
    CloseCall,
    """
local refused = no_session(meta, token_hash)
if refused then return refused end
local status = redis.call('HGET', meta, 'status')
if status and status ~= '$STATUS_DONE' then
  if counters(meta) ~= expected_counters then return {'$REPLY_MOVED'} end
  cancel(meta, turn_stream, cancelled_event, '$STATUS_DONE')
end
for _, other in ipairs(other_keys) do redis.call('DEL', other) end
redis.call('DEL', meta)
redis.call('EXPIRE', turn_stream, linger_s)
return {'$REPLY_OK'}
""",
)


# Engine: give a running turn back (drain): queued again, no engine, so that
# any engine claims it at once from the shared queue and rebuilds it from the
# token log. Fenced like a publish: a turn taken over meanwhile is not ours.
class ReleaseCall(Script):
    meta: str = key()
    engine_id: str = arg()
    epoch: int = arg()
    allowed_from: str = arg()
    target: str = arg()


RELEASE = _declare(
    ReleaseCall,
    """
local refused = no_session(meta)
if refused then return refused end
if redis.call('HGET', meta, 'engine') ~= engine_id or redis.call('HGET', meta, 'epoch') ~= epoch
then
  return {'$REPLY_FENCED'}
end
refused = not_allowed(redis.call('HGET', meta, 'status'), allowed_from)
if refused then return refused end
redis.call('HSET', meta, 'status', target, 'engine', '')
return {'$REPLY_OK'}
""",
)

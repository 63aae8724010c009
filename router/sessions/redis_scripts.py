"""Key layout and Lua scripts of the Redis session store (server side; each call is one round trip and atomic).

Keys, all under ``P = sessions.key_prefix``::

    P s:<session_key>   hash {w: worker_id, t: last refresh, c: creation, ms of Redis TIME}   PEXPIRE idle_timeout_s
    P idx               zset member=session_key score=t          (list/count across replicas, most recent first)
    P w:<worker_id>     zset member=session_key score=t          (drop_worker without a SCAN)
    P changes           pub/sub channel, one msgpack message per ownership change

Why per-worker zsets rather than a SCAN for ``drop_worker``: SCAN walks the whole keyspace (every session of every
worker, and anything else in the database) in many round trips; the per-worker zset is O(that worker's
sessions) in one script. Both zsets use the refresh time as score, so a member whose score is
``<= now - idle_timeout`` belongs to a key whose TTL has run out; scripts trim those lazily
(``ZREMRANGEBYSCORE``), so the zsets stay bounded by the live sessions plus one refresh interval of stale ones.

Scripts build the ``w:<worker>`` and ``s:<key>`` names from ``ARGV`` (the owner is only known inside the
script), so they need every key on one node: a single Redis, or Sentinel; not Redis Cluster.

Messages on ``P changes`` (msgpack array; Lua's built-in ``cmsgpack``):
    ``["m", session_key, new_worker_id]`` moved; ``["d", session_key]`` dropped; ``["w", worker_id]`` every session
    of that worker dropped. A first claim publishes nothing: no replica can hold a cached owner for a session
    that has none (local cache TTLs are far shorter than the idle timeout; a drop published its own message).

Timestamps come from ``redis.call('TIME')`` so every replica orders sessions on one clock (Redis >= 5
replicates script effects, which makes the non-deterministic ``TIME`` allowed before writes).
"""

from __future__ import annotations

_NOW_MS = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1]=P s:key, KEYS[2]=P idx; ARGV[1]=proposed worker, ARGV[2]=idle_ms, ARGV[3]='1' to refresh the TTL,
# ARGV[4]=session key, ARGV[5]=P.  Returns {owner, t_ms, is_new 0|1}.
CLAIM_OR_TOUCH = _NOW_MS + """
local cur = redis.call('HMGET', KEYS[1], 'w', 't')
local owner = cur[1]
local wkey
if owner then
  if ARGV[3] ~= '1' then
    return {owner, tonumber(cur[2]) or 0, 0}
  end
  wkey = ARGV[5] .. 'w:' .. owner
else
  owner = ARGV[1]
  wkey = ARGV[5] .. 'w:' .. owner
  redis.call('HSET', KEYS[1], 'w', owner, 'c', now_ms)
end
redis.call('HSET', KEYS[1], 't', now_ms)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local stale = now_ms - tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], now_ms, ARGV[4])
redis.call('ZADD', wkey, now_ms, ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', stale)
redis.call('ZREMRANGEBYSCORE', wkey, '-inf', stale)
if cur[1] then return {owner, now_ms, 0} end
return {owner, now_ms, 1}
"""

# Claim-if-absent used when writing back sessions created while Redis was unreachable: the same as a first claim
# of CLAIM_OR_TOUCH with refresh, so Redis's owner (if any) wins.  Same KEYS/ARGV/return.
WRITE_BACK = CLAIM_OR_TOUCH

# KEYS[1]=P s:key, KEYS[2]=P idx; ARGV[1]=expected worker, ARGV[2]=new worker, ARGV[3]=idle_ms,
# ARGV[4]=session key, ARGV[5]=P, ARGV[6]=channel.  Returns 1 if moved (or already the expected owner and
# new == expected), 0 if the owner is not ARGV[1] (or there is none).
MOVE = """
local owner = redis.call('HGET', KEYS[1], 'w')
if owner ~= ARGV[1] then return 0 end
""" + _NOW_MS + """
if ARGV[2] ~= ARGV[1] then
  redis.call('HSET', KEYS[1], 'w', ARGV[2])
  redis.call('ZREM', ARGV[5] .. 'w:' .. ARGV[1], ARGV[4])
  redis.call('PUBLISH', ARGV[6], cmsgpack.pack({'m', ARGV[4], ARGV[2]}))
end
redis.call('HSET', KEYS[1], 't', now_ms)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], now_ms, ARGV[4])
redis.call('ZADD', ARGV[5] .. 'w:' .. ARGV[2], now_ms, ARGV[4])
return 1
"""

# KEYS[1]=P s:key, KEYS[2]=P idx; ARGV[1]=session key, ARGV[2]=P, ARGV[3]=channel.  Returns 1 if it existed.
DROP = """
local owner = redis.call('HGET', KEYS[1], 'w')
redis.call('ZREM', KEYS[2], ARGV[1])
if not owner then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', ARGV[2] .. 'w:' .. owner, ARGV[1])
redis.call('PUBLISH', ARGV[3], cmsgpack.pack({'d', ARGV[1]}))
return 1
"""

# KEYS[1]=P w:worker, KEYS[2]=P idx; ARGV[1]=worker, ARGV[2]=P, ARGV[3]=channel.  Returns how many live
# sessions it dropped.  O(sessions of that worker) in one script.
DROP_WORKER = """
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local n = 0
for _, k in ipairs(members) do
  local skey = ARGV[2] .. 's:' .. k
  if redis.call('HGET', skey, 'w') == ARGV[1] then
    redis.call('DEL', skey)
    redis.call('ZREM', KEYS[2], k)
    n = n + 1
  end
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[3], cmsgpack.pack({'w', ARGV[1]}))
return n
"""

# KEYS[1]=P idx; ARGV[1]=limit, ARGV[2]=idle_ms, ARGV[3]=P.  Returns a flat list
# {key1, worker1, t_ms1, key2, ...}, most recently refreshed first.
LIST = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - tonumber(ARGV[2]))
local limit = tonumber(ARGV[1])
local out = {}
if limit <= 0 then return out end
local members = redis.call('ZREVRANGE', KEYS[1], 0, limit - 1, 'WITHSCORES')
for i = 1, #members, 2 do
  local w = redis.call('HGET', ARGV[3] .. 's:' .. members[i], 'w')
  if w then
    out[#out + 1] = members[i]
    out[#out + 1] = w
    out[#out + 1] = members[i + 1]
  end
end
return out
"""

# KEYS[1]=P idx; ARGV[1]=idle_ms.  Returns the number of live sessions.
COUNT = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - tonumber(ARGV[1]))
return redis.call('ZCARD', KEYS[1])
"""


# KEYS[1]=the zset to walk (P idx, or P w:<worker> for one worker's sessions); ARGV[1]=P, ARGV[2]=idle_ms,
# ARGV[3]=min_idle_ms, ARGV[4]=max_idle_ms or '', ARGV[5]=min_age_ms, ARGV[6]=worker or '', ARGV[7]=key prefix,
# ARGV[8]=offset, ARGV[9]=page size, ARGV[10]='1' to drop what matches, ARGV[11]=channel.
# Looks at one page of the zset, most recently refreshed first, within the idle bounds (ZREVRANGEBYSCORE ... LIMIT
# offset count: the script's work is bounded by the page); returns {now_ms, num_looked_at, key1, worker1, t_ms1,
# c_ms1, key2, ...} for the sessions that match (dropped, each published as a drop, when ARGV[10] is '1'). A
# session created before the 'c' field existed reads as created at its last refresh.
SWEEP = _NOW_MS + """
local hi = now_ms - tonumber(ARGV[3])
local lo = now_ms - tonumber(ARGV[2])
if ARGV[4] ~= '' then
  local oldest = now_ms - tonumber(ARGV[4]) - 1
  if oldest > lo then lo = oldest end
end
local members = redis.call('ZREVRANGEBYSCORE', KEYS[1], hi, '(' .. lo, 'LIMIT', ARGV[8], ARGV[9])
local out = {now_ms, #members}
local prefix = ARGV[7]
local min_age = tonumber(ARGV[5])
for _, k in ipairs(members) do
  if prefix == '' or string.sub(k, 1, #prefix) == prefix then
    local skey = ARGV[1] .. 's:' .. k
    local cur = redis.call('HMGET', skey, 'w', 't', 'c')
    local w = cur[1]
    if w and (ARGV[6] == '' or w == ARGV[6]) then
      local t = tonumber(cur[2]) or 0
      local c = tonumber(cur[3]) or t
      if now_ms - c >= min_age then
        if ARGV[10] == '1' then
          redis.call('DEL', skey)
          redis.call('ZREM', ARGV[1] .. 'idx', k)
          redis.call('ZREM', ARGV[1] .. 'w:' .. w, k)
          redis.call('PUBLISH', ARGV[11], cmsgpack.pack({'d', k}))
        end
        out[#out + 1] = k
        out[#out + 1] = w
        out[#out + 1] = t
        out[#out + 1] = c
      end
    end
  end
end
return out
"""

SWEEP_PAGE = 1000
"""Sessions ``SWEEP`` looks at per call (one round trip; about a millisecond of Redis time)."""


def session_key_name(key_prefix: str, session_key: str) -> str:
    """Redis key of one session's hash."""
    return f"{key_prefix}s:{session_key}"


def index_key_name(key_prefix: str) -> str:
    """Redis key of the zset of all sessions."""
    return f"{key_prefix}idx"


def worker_key_name(key_prefix: str, worker_id: str) -> str:
    """Redis key of the zset of one worker's sessions."""
    return f"{key_prefix}w:{worker_id}"


def channel_name(key_prefix: str) -> str:
    """Pub/sub channel of ownership changes."""
    return f"{key_prefix}changes"

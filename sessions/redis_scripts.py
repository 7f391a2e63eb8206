"""The Lua scripts of the Redis session store: each of a session's writes, and its lease, is one script, so that it
is atomic (its keys share one hash tag: one Cluster slot) and a retry cannot apply it twice."""

# Take the lease if free, and only then advance the session's fence; in the same round trip, read the session as the
# turn will run it. KEYS lease, fence, meta, messages, tokens. Returns {fence, meta, messages, tokens} or nil. A retry
# that finds the lease its own (the reply to the first try was lost) gets the fence that try took; a lease this worker
# could not release (ARGV[4], its token) is taken over. With ARGV[5] '1', a session that does not exist is 0, and
# nothing is written (a client naming made-up sessions leaves no keys behind).
ACQUIRE = """
if ARGV[5] == '1' and redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
local fence = nil
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  fence = tonumber(redis.call('GET', KEYS[2]))
else
  if held == ARGV[4] then redis.call('DEL', KEYS[1]) end
  if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    fence = redis.call('INCR', KEYS[2])
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
end
if not fence then return nil end
return {fence, redis.call('HGETALL', KEYS[3]), redis.call('LRANGE', KEYS[4], 0, -1), redis.call('GET', KEYS[5])}
"""
RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# A session as one consistent read (one round trip, on a cluster too): KEYS meta, messages, tokens.
READ = """
return {redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1), redis.call('GET', KEYS[3])}
"""
# Lua's `unpack` fails past about 8,000 values (its C stack): messages are pushed this many at a time.
PUSH_BATCH = 1000
# RPUSH the messages in ARGV[first..], a batch at a time (a branched history may hold thousands of messages).
PUSH = f"""
local function push(key, first)
  for i = first, #ARGV, {PUSH_BATCH} do
    redis.call('RPUSH', key, unpack(ARGV, i, math.min(i + {PUSH_BATCH - 1}, #ARGV)))
  end
end
"""
# A new session: KEYS meta, messages; ARGV retention (s), the meta fields as a JSON object of strings, messages...
CREATE = PUSH + """
for name, value in pairs(cjson.decode(ARGV[2])) do redis.call('HSET', KEYS[1], name, value) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
if #ARGV > 2 then
  push(KEYS[2], 3)
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
return 'ok'
"""
# A completed turn: KEYS meta, messages, tokens, fence, lease; ARGV expected version, fence ('' for none), retention
# (s), updated_at, dropped_turns, this write's id, packed token ids, the lease's token ('' for none), messages...
# Returns 'ok', 'done' (this write was applied already: a retry), 'gone', 'fence' or 'version <stored>'. Once the turn
# is written the lease is let go in the same round trip (if it is still the writer's: never a newer holder's).
APPEND = PUSH + """
local function let_go()
  if ARGV[8] ~= '' and redis.call('GET', KEYS[5]) == ARGV[8] then redis.call('DEL', KEYS[5]) end
end
local stored = redis.call('HGET', KEYS[1], 'version')
if not stored then return 'gone' end
if tonumber(stored) == tonumber(ARGV[1]) + 1 and redis.call('HGET', KEYS[1], 'write') == ARGV[6] then
  let_go()
  return 'done'
end
if tonumber(stored) ~= tonumber(ARGV[1]) then return 'version ' .. stored end
if ARGV[2] ~= '' and tonumber(redis.call('GET', KEYS[4]) or '0') ~= tonumber(ARGV[2]) then return 'fence' end
push(KEYS[2], 9)
redis.call('SET', KEYS[3], ARGV[7])
redis.call('HSET', KEYS[1], 'version', tostring(tonumber(ARGV[1]) + 1), 'updated_at', ARGV[4],
           'dropped_turns', ARGV[5], 'write', ARGV[6])
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
let_go()
return 'ok'
"""

# An edited history (an item deleted): KEYS meta, messages, tokens, lease; ARGV expected version, retention (s),
# updated_at, system (JSON), removed_items, dropped_turns, messages... Returns 'ok', 'gone', 'busy' (a worker holds its
# lease: a turn runs) or 'version <stored>'. The reached token ids are dropped: the next turn writes them.
REWRITE = PUSH + """
local stored = redis.call('HGET', KEYS[1], 'version')
if not stored then return 'gone' end
if tonumber(stored) ~= tonumber(ARGV[1]) then return 'version ' .. stored end
if redis.call('EXISTS', KEYS[4]) == 1 then return 'busy' end
redis.call('DEL', KEYS[2], KEYS[3])
push(KEYS[2], 7)
redis.call('HSET', KEYS[1], 'version', tostring(tonumber(ARGV[1]) + 1), 'updated_at', ARGV[3], 'system', ARGV[4],
           'removed_items', ARGV[5], 'dropped_turns', ARGV[6])
for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
return 'ok'
"""

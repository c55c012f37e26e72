-- Hand a claimed message back: to its queue (score = deadline) or to the retry set
-- (score = Redis now + delay). A claim no longer held is left alone: the reaper already
-- put the message back, and adding it again would duplicate it.
-- KEYS[1] in-flight zset, KEYS[2] in-flight hash, KEYS[3] target zset
-- ARGV[1] claim id, ARGV[2] member, ARGV[3] score, ARGV[4] "delay" (score is relative to now,
--   capped at ARGV[5], the deadline, so the retry mover brings it back to its queue in time
--   for the deadline sweep) or "at" (absolute score)
-- Returns 1 when handed back, 0 when the claim was not held.
-- The write comes before the ack: if it fails, the claim stays held and nothing is lost.
expect_types(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'zset')
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
local score = tonumber(ARGV[3])
if ARGV[4] == 'delay' then
  local t = redis.call('TIME')
  score = math.min(tonumber(t[1]) + tonumber(t[2]) / 1000000 + score, tonumber(ARGV[5]))
end
redis.call('ZADD', KEYS[3], score, ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1

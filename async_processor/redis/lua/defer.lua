-- Hand a claimed message back: to its queue (score = deadline and submission order) or to
-- the retry set (score = Redis now + delay), and delete its claim; fenced as upstream's
-- release: a claim no longer ours is left alone (it was reclaimed, and adding the message
-- again would duplicate it).
-- KEYS[1] <queue>:claimed, KEYS[2] <queue>:claim-owners, KEYS[3] <queue>:claims-idx,
-- KEYS[4] target zset
-- ARGV[1] claim key, ARGV[2] member, ARGV[3] score, ARGV[4] "delay" (score is relative to
--   now, capped at ARGV[5], the deadline, so the retry mover brings it back to its queue in
--   time for the deadline sweep) or "at" (absolute score), ARGV[6] owner token
-- Returns 1 when handed back, 0 when the claim was not ours.
-- The write comes before the ack: if it fails, the claim stays held and nothing is lost.
expect_types(KEYS[1], 'hash', KEYS[2], 'hash', KEYS[3], 'zset', KEYS[4], 'zset')
if ARGV[6] == '' or redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[6] then
  return 0
end
local score = tonumber(ARGV[3])
if ARGV[4] == 'delay' then
  score = math.min(server_now() + score, tonumber(ARGV[5]))
end
redis.call('ZADD', KEYS[4], score, ARGV[2])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1

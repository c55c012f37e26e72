-- Park a claimed message on the dead-letter list (capped: the oldest entries beyond
-- ARGV[3] are trimmed) and delete its claim, fenced (only while the claim is ours).
-- KEYS[1] <queue>:claimed, KEYS[2] <queue>:claim-owners, KEYS[3] <queue>:claims-idx,
-- KEYS[4] dead-letter list
-- ARGV[1] claim key, ARGV[2] dead-letter entry (JSON), ARGV[3] most entries kept,
-- ARGV[4] owner token
-- Returns {1 when parked (0 when the claim was not ours: it was reclaimed already),
-- entries trimmed}.
-- The write comes before the ack: if it fails, the claim stays held and nothing is lost.
expect_types(KEYS[1], 'hash', KEYS[2], 'hash', KEYS[3], 'zset', KEYS[4], 'list')
if ARGV[4] == '' or redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[4] then
  return {0, 0}
end
local cap = tonumber(ARGV[3])
local length = redis.call('LPUSH', KEYS[4], ARGV[2])
-- Always, not only when over the cap: an ACL user without LTRIM fails on the first dead
-- letter (where a test sees it), not on the 100,001st. LPUSH puts the newest first.
redis.call('LTRIM', KEYS[4], 0, cap - 1)
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return {1, math.max(0, length - cap)}

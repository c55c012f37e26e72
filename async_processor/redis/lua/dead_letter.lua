-- Park a claimed message on the dead-letter list (capped: the oldest entries beyond
-- ARGV[3] are trimmed) and acknowledge its claim.
-- KEYS[1] in-flight zset, KEYS[2] in-flight hash, KEYS[3] dead-letter list
-- ARGV[1] claim id, ARGV[2] dead-letter entry (JSON), ARGV[3] most entries kept
-- Returns {1 when parked (0 when the claim was not held: the reaper put it back already),
-- entries trimmed}.
-- The write comes before the ack: if it fails, the claim stays held and nothing is lost.
expect_types(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'list')
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return {0, 0}
end
local cap = tonumber(ARGV[3])
local length = redis.call('LPUSH', KEYS[3], ARGV[2])
-- Always, not only when over the cap: an ACL user without LTRIM fails on the first dead
-- letter (where a test sees it), not on the 100,001st. LPUSH puts the newest first.
redis.call('LTRIM', KEYS[3], 0, cap - 1)
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return {1, math.max(0, length - cap)}

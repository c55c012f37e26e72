-- Park a claimed message on the dead-letter list and acknowledge its claim.
-- KEYS[1] in-flight zset, KEYS[2] in-flight hash, KEYS[3] dead-letter list
-- ARGV[1] claim id, ARGV[2] dead-letter entry (JSON)
-- Returns 1 when parked, 0 when the claim was not held (the reaper put it back already).
-- The write comes before the ack: if it fails, the claim stays held and nothing is lost.
expect_types(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'list')
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
redis.call('LPUSH', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1

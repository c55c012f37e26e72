-- Park a claimed message on the dead-letter list and acknowledge its claim.
-- KEYS[1] in-flight zset, KEYS[2] in-flight hash, KEYS[3] dead-letter list
-- ARGV[1] claim id, ARGV[2] dead-letter entry (JSON)
-- Returns 1 when parked, 0 when the claim was not held (the reaper put it back already).
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('LPUSH', KEYS[3], ARGV[2])
return 1

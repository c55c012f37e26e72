-- redis-quota, concurrency mode: take one slot.
-- KEYS[1] quota key; ARGV limit, ttl seconds. 1 = reserved, 0 = over the limit.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current >= tonumber(ARGV[1]) then return 0 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1

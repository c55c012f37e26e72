-- redis-quota, concurrency mode: give one slot back.
-- Never below zero; a key left at 0 keeps its TTL and expires on its own.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current > 0 then
  local left = redis.call('DECR', KEYS[1])
  if left > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
end
return 1

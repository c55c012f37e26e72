-- redis-quota, rate-limit mode: one request in the window.
-- Sliding-window log. ARGV now_ns, window_ns, limit, ttl, member. The member carries a
-- unique suffix so two acquires in the same nanosecond both count (the reference's
-- member == score collapses them).
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, now - tonumber(ARGV[2]))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1

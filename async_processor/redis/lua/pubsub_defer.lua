-- Add to the retry set, due ARGV[2] seconds after Redis's clock (the mover's clock).
-- KEYS[1] retry set; ARGV[1] member, ARGV[2] delay.
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2]), ARGV[1])
return 1

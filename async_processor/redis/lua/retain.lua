-- Result retention for one result list: record how many results it has had, and trim
-- those older than the TTL that nobody consumed.
-- KEYS[1] result list (LPUSH by the daemon, consumed from the right),
-- KEYS[2] its results-pushed counter (created here, INCR by complete.lua), KEYS[3] its
-- marks: a zset of member = pushed count, score = the first time that count was seen
-- (Redis clock).
-- ARGV[1] TTL seconds (0: never trim), ARGV[2] how long marks are kept (seconds),
-- ARGV[3] grace seconds: the three keys expire unless the next round renews them (the list
-- TTL + grace on, so what a round no longer covers is gone once past its TTL; the counter
-- and marks after their horizon + grace).
-- Result n (1 = the first ever pushed) was written no later than the first mark whose
-- count is >= n. The list holds results pushed - len + 1 .. pushed (oldest on the right),
-- so with the newest mark at least TTL old holding count c, the c - (pushed - len) oldest
-- entries are past the TTL: they are trimmed from the right.
-- Returns {trimmed, length after, pushed}; {0, -1, 0} when a key has a foreign type.
if not (usable_as(KEYS[1], 'list') and usable_as(KEYS[2], 'string')
    and usable_as(KEYS[3], 'zset')) then
  return {0, -1, 0}
end
local now = server_now()
-- The counter starts here, with its first mark below, so only retained lists are counted
-- (complete.lua increments existing counters). Results pushed before it are dated by
-- that first mark (count 0), which they precede.
local pushed = tonumber(redis.call('GET', KEYS[2]) or '0')
if pushed == 0 then
  redis.call('SET', KEYS[2], '0', 'NX')
end
local len = redis.call('LLEN', KEYS[1])
local ttl = tonumber(ARGV[1])
local trimmed = 0
if ttl > 0 then
  local old = redis.call('ZREVRANGEBYSCORE', KEYS[3], now - ttl, '-inf', 'LIMIT', 0, 1)
  if #old > 0 then
    trimmed = math.min(tonumber(old[1]) - (pushed - len), len)
  end
  if trimmed >= len and len > 0 then
    redis.call('DEL', KEYS[1])
  elseif trimmed > 0 then
    redis.call('LTRIM', KEYS[1], 0, len - trimmed - 1)
  else
    trimmed = 0
  end
end
redis.call('ZADD', KEYS[3], 'NX', string.format('%.6f', now), pushed)
-- Keep the newest mark older than the horizon: it still bounds what came after it.
local keep = redis.call('ZREVRANGEBYSCORE', KEYS[3], now - tonumber(ARGV[2]), '-inf',
  'LIMIT', 0, 1)
if #keep > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf',
    '(' .. redis.call('ZSCORE', KEYS[3], keep[1]))
end
local grace = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl + grace)
else  -- kept: an expiry set while a TTL was configured must not delete it
  redis.call('PERSIST', KEYS[1])
end
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]) + grace)
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]) + grace)
return {trimmed, len - trimmed, pushed}

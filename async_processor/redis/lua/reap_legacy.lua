-- The current release's claims (<queue>:inflight, <queue>:inflight:meta; no longer written):
-- put up to ARGV[1] whose lease expired back on their queue, with their original score, so
-- pods of that release rolled out (or killed) during an upgrade lose nothing.
-- KEYS[1] queue zset, KEYS[2] in-flight zset, KEYS[3] in-flight hash; ARGV[1] max count
-- Returns {expired claims taken, those of them without a lease entry}. A claim without its
-- entry (evicted, deleted by hand) has no bytes to put back: it is dropped, and counted so
-- the daemon reports the message it may have lost; the claim id does not name the request.
expect_types(KEYS[1], 'zset', KEYS[2], 'zset', KEYS[3], 'hash')
local now = server_now()
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local missing = 0
for _, claim in ipairs(expired) do
  local entry = redis.call('HGET', KEYS[3], claim)
  if entry then
    local sep = string.find(entry, '|', 1, true)
    redis.call('ZADD', KEYS[1], string.sub(entry, 1, sep - 1), string.sub(entry, sep + 1))
    redis.call('HDEL', KEYS[3], claim)
  else
    missing = missing + 1
  end
  redis.call('ZREM', KEYS[2], claim)
end
return {#expired, missing}

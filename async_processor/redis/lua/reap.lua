-- Reclaim, as upstream's reclaimer does: put up to ARGV[1] claims whose lease expired back
-- on their queue, whoever holds them (a Go daemon or ours), at their queue score (deadline
-- plus the submission-order fraction, lib.lua queue_score), and delete their claim.
-- KEYS[1] queue zset, KEYS[2] <queue>:claimed, KEYS[3] <queue>:claim-owners,
-- KEYS[4] <queue>:claims-idx; ARGV[1] max count.
-- Returns {expired claims taken, those of them without a member}. An index entry without
-- its member (evicted, deleted by hand) has nothing to put back: it is removed (as
-- upstream does) and counted, so the daemon reports the message it may have lost.
expect_types(KEYS[1], 'zset', KEYS[2], 'hash', KEYS[3], 'hash', KEYS[4], 'zset')
local now = server_now()
local expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local missing = 0
for _, key in ipairs(expired) do
  local member = redis.call('HGET', KEYS[2], key)
  if member then
    -- An undecodable member goes first (score 0): the next claim answers it at once.
    redis.call('ZADD', KEYS[1], queue_score(envelope_of(member), 0), member)
    redis.call('HDEL', KEYS[2], key)
  else
    missing = missing + 1
  end
  redis.call('HDEL', KEYS[3], key)
  redis.call('ZREM', KEYS[4], key)
end
return {#expired, missing}

-- Extend the leases of claims this process still holds, for several queues in one call
-- (all in one slot in cluster mode): the heartbeat's one call per slot group, not one
-- per queue (200 tenant queues each holding a prefetched claim: 200 calls a round).
-- KEYS[i] in-flight zset of queue i; ARGV[1] lease seconds; then, per queue in KEYS
-- order, the count n of its claim ids followed by those n ids.
-- Returns per queue the claim ids no longer held (reclaimed by a reaper, or
-- acknowledged), or the WRONGTYPE text of a queue whose in-flight key has the wrong type:
-- that queue is left alone, the others are extended.
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
local replies = {}
local at = 2
for q = 1, #KEYS do
  local n = tonumber(ARGV[at])
  if usable_as(KEYS[q], 'zset') then
    local lost = {}
    for i = at + 1, at + n do
      if redis.call('ZSCORE', KEYS[q], ARGV[i]) then
        redis.call('ZADD', KEYS[q], 'XX', expiry, ARGV[i])
      else
        lost[#lost + 1] = ARGV[i]
      end
    end
    replies[q] = lost
  else
    replies[q] = 'WRONGTYPE key ' .. KEYS[q] .. ' is not a sorted set'
  end
  at = at + n + 1
end
return replies

-- Per queue retry sets (cluster mode, discovered queues): move up to ARGV[1] due members of
-- each retry set back to its own queue, scored by their deadline. One call covers many
-- queues (all in one slot in cluster mode), so upkeep costs one call, not one per queue.
-- KEYS: retry set 1, queue 1, retry set 2, queue 2, ...; ARGV[1] max count per queue.
-- Returns the most members moved for one queue (a full chunk means: call again).
for i = 1, #KEYS do
  expect_types(KEYS[i], 'zset')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local most = 0
for i = 1, #KEYS, 2 do
  local due = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
  for _, member in ipairs(due) do
    redis.call('ZADD', KEYS[i + 1], deadline_of(envelope_of(member), now), member)
    redis.call('ZREM', KEYS[i], member)
  end
  if #due > most then
    most = #due
  end
end
return most

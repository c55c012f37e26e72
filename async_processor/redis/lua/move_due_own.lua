-- Per queue retry sets (cluster mode, discovered queues): move up to ARGV[1] due members of
-- each retry set back to its own queue, scored by their deadline and submission order. One call covers many
-- queues (all in one slot in cluster mode), so upkeep costs one call, not one per queue.
-- KEYS: retry set 1, queue 1, retry set 2, queue 2, ...; ARGV[1] max count per queue.
-- Returns {most, queue, error, queue, error, ...}: the most members moved for one queue (a
-- full chunk means: call again), then the WRONGTYPE text of each queue whose retry set or
-- queue has the wrong type: that queue is left alone, the others' due members move.
-- Retry sets are almost always empty, so the call reads first (one EXISTS for all sets, a
-- ZRANGEBYSCORE per set that exists, which also tells a wrong type), type-checks only the
-- queues due members go to, and writes last: every key written was checked before the
-- first write, without a TYPE per idle queue (200 tenant queues, 400 TYPEs a round).
local most, failed, sets = 0, {}, {}
for i = 1, #KEYS, 2 do
  sets[#sets + 1] = KEYS[i]
end
if redis.call('EXISTS', unpack(sets)) == 0 then
  return {most}
end
local now = server_now()
local moves = {}
for i = 1, #KEYS, 2 do
  local due = redis.pcall('ZRANGEBYSCORE', KEYS[i], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
  if due['err'] ~= nil then
    failed[#failed + 1] = KEYS[i + 1]
    failed[#failed + 1] = 'WRONGTYPE key ' .. KEYS[i] .. ' is not a sorted set'
  elseif #due > 0 then
    if usable_as(KEYS[i + 1], 'zset') then
      moves[#moves + 1] = {i, due}
    else
      failed[#failed + 1] = KEYS[i + 1]
      failed[#failed + 1] = 'WRONGTYPE key ' .. KEYS[i + 1] .. ' is not a sorted set'
    end
  end
end
for _, move in ipairs(moves) do
  local i, due = move[1], move[2]
  for _, member in ipairs(due) do
    redis.call('ZADD', KEYS[i + 1], queue_score(envelope_of(member), now), member)
    redis.call('ZREM', KEYS[i], member)
  end
  if #due > most then
    most = #due
  end
end
return {most, unpack(failed)}

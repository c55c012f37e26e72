-- Move up to ARGV[1] due members of the retry set back to their origin queue, scored by
-- their deadline and submission order (lib.lua queue_score). The origin is the envelope's internal.request_queue_name (the daemon
-- writes the queue it claimed the message from there when it defers it) if that is one of
-- the configured queues KEYS[2..], else KEYS[2] (the reference's "first configured
-- queue"): a message can never move itself into a key nobody polls.
-- KEYS[1] retry set (score = due time), KEYS[2..] configured request queues; ARGV[1] max count
-- Returns how many members were moved.
-- Read first: only the queues due members go to are type-checked (all before the first
-- write), not every configured queue each round while the retry set is empty.
local queues = {}
for i = 2, #KEYS do
  queues[KEYS[i]] = true
end
expect_types(KEYS[1], 'zset')
local now = server_now()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local moves = {}
for j, member in ipairs(due) do
  local msg, origin = envelope_of(member), KEYS[2]
  local routing = msg and msg['internal']
  if type(routing) == 'table' and queues[routing['request_queue_name']] then
    origin = routing['request_queue_name']
  end
  expect_types(origin, 'zset')
  moves[j] = {origin, queue_score(msg, now)}
end
for j, member in ipairs(due) do
  redis.call('ZADD', moves[j][1], moves[j][2], member)
  redis.call('ZREM', KEYS[1], member)
end
return #due

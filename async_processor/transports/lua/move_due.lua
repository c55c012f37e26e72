-- Move up to ARGV[1] due members of the retry set back to their origin queue, scored by
-- their deadline. The origin is the envelope's internal.request_queue_name, else KEYS[2]
-- (the reference's "first configured queue"). Origin queues are computed here, so this
-- script (like the reference's keys) needs a standalone Redis, not a cluster.
-- KEYS[1] retry set (score = due time), KEYS[2] fallback queue; ARGV[1] max count
-- Returns how many members were moved.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, member in ipairs(due) do
  local origin, deadline = KEYS[2], now
  local ok, msg = pcall(cjson.decode, member)
  if ok and type(msg) == 'table' then
    local data = msg['data']
    if type(data) ~= 'table' then
      data = msg
    end
    local routing = msg['internal']
    if type(routing) == 'table' then
      local name = routing['request_queue_name']
      if type(name) == 'string' and name ~= '' and name ~= KEYS[1] then
        origin = name
      end
    end
    if type(data['deadline']) == 'number' then
      deadline = data['deadline']
    end
  end
  -- The origin comes from the message and may name a key of another type: then the
  -- fallback queue, so one bad member neither gets lost nor blocks the ones behind it.
  local added = redis.pcall('ZADD', origin, deadline, member)
  if type(added) == 'table' and added.err then
    redis.call('ZADD', KEYS[2], deadline, member)
  end
  redis.call('ZREM', KEYS[1], member)
end
return #due

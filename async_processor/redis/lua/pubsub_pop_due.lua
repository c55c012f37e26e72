-- Prepended with lua/lib.lua (envelope_of).
-- Pop due retries of our channels, at most ``room`` per channel (what our buffers can take);
-- others' retries are left for the replicas that subscribe to their channel.
-- KEYS[1] retry set, KEYS[2] this pop's record (named by a pop id unique per process and
-- pop); ARGV[1] members to examine, ARGV[2] record TTL, then pairs (channel, room).
-- Returns a flat list {channel, member, ...}. The record makes it idempotent: redis-py
-- sends the same call again when the reply was lost, and gets the same batch back
-- instead of the next one (the first would be gone: popped, and nobody got it).
local done = redis.call('LRANGE', KEYS[2], 0, -1)
if #done > 0 then
  return done
end
local now = server_now()
local room = {}
for i = 3, #ARGV, 2 do
  room[ARGV[i]] = tonumber(ARGV[i + 1])
end
local out = {}
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, member in ipairs(due) do
  local msg = envelope_of(member)
  if msg and type(msg['internal']) == 'table' then
    local name = msg['internal']['request_queue_name']
    if type(name) == 'string' and (room[name] or 0) > 0 then
      room[name] = room[name] - 1
      redis.call('ZREM', KEYS[1], member)
      out[#out + 1] = name
      out[#out + 1] = member
    end
  end
end
if #out > 0 then
  redis.call('RPUSH', KEYS[2], unpack(out))
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
end
return out

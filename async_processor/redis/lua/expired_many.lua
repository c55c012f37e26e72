-- The deadline sweep's first look at many queues in one call (all in one slot in cluster
-- mode): per queue KEYS[i], up to ARGV[3] members whose score (deadline) is <= ARGV[1], as
-- in expired.lua (a member over ARGV[4] bytes comes back as ""). Read only.
-- Returns one array of members per queue, in KEYS order, or a queue's WRONGTYPE text.
-- A queue whose key has the wrong type gets its WRONGTYPE text instead of its members (the
-- others are still read): the ZRANGEBYSCORE tells it, so a healthy queue costs no TYPE.
local whole = tonumber(ARGV[4])
local out = {}
for i = 1, #KEYS do
  local members = redis.pcall('ZRANGEBYSCORE', KEYS[i], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
  if members['err'] ~= nil then
    members = 'WRONGTYPE key ' .. KEYS[i] .. ' is not a sorted set'
  else
    for j, member in ipairs(members) do
      if #member > whole then
        members[j] = ''
      end
    end
  end
  out[i] = members
end
return out

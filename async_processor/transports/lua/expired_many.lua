-- The deadline sweep's first look at many queues in one call (all in one slot in cluster
-- mode): per queue KEYS[i], up to ARGV[3] members whose score (deadline) is <= ARGV[1], as
-- in expired.lua (a member over ARGV[4] bytes comes back as ""). Read only.
-- Returns one array of members per queue, in KEYS order.
local whole = tonumber(ARGV[4])
local out = {}
for i = 1, #KEYS do
  expect_types(KEYS[i], 'zset')
end
for i = 1, #KEYS do
  local members = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
  for j, member in ipairs(members) do
    if #member > whole then
      members[j] = ''
    end
  end
  out[i] = members
end
return out

-- Read (never write) up to ARGV[3] members of a queue whose score (deadline) is <= ARGV[1],
-- skipping the first ARGV[2]; a member over ARGV[4] bytes comes back as "" so the deadline
-- sweep never transfers it (a worker answers it INVALID_REQUEST from its prefix).
-- KEYS[1] queue zset. Returns the members, in score order.
expect_types(KEYS[1], 'zset')
local whole = tonumber(ARGV[4])
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', ARGV[2], ARGV[3])
for i, member in ipairs(members) do
  if #member > whole then
    members[i] = ''
  end
end
return members

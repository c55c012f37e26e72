-- Extend the leases of claims this process still holds.
-- KEYS[1] in-flight zset; ARGV[1] lease seconds; ARGV[2..] claim ids
-- Returns the claim ids that are no longer held (reclaimed by a reaper, or acknowledged).
expect_types(KEYS[1], 'zset')
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
local lost = {}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost

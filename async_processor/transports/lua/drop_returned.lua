-- Remove from its queue a completed message whose lease had lapsed (the reaper put it
-- back), known by its score, first bytes, size and SHA-1 only: the daemon lets a message's
-- bytes go once its request is written (docs/sizing-and-backpressure.md), and fetches only
-- a prefix of one over --max-message-bytes; the lease hash lost the member when the reaper
-- returned it.
-- KEYS[1] queue zset. ARGV[1] the member's score, ARGV[2] its first bytes, ARGV[3] its size,
-- ARGV[4] its SHA-1 (hex), ARGV[5] most members of that score and those first bytes compared.
-- Returns 1 when removed, 0 when not there (claimed again, answered, or never put back),
-- -1 when the comparisons ran out first (left to the dedup marker).
-- Members of one score are ordered by their bytes, so the first one starting with ARGV[2]
-- is found by a binary search over ranks (ZRANGE by rank, O(log n) each): a thousand
-- messages sharing a deadline cost ~10 lookups, not a thousand comparisons.
expect_types(KEYS[1], 'zset')
local queue, score, prefix = KEYS[1], ARGV[1], ARGV[2]
local size, digest, most = tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])

-- Byte order, not Lua's '<' (strcoll: Redis sets the collation locale from the system).
local function before_prefix(member)
  for i = 1, #prefix do
    local a, b = string.byte(member, i), string.byte(prefix, i)
    if a == nil then
      return true
    end
    if a ~= b then
      return a < b
    end
  end
  return false
end

local lo = redis.call('ZCOUNT', queue, '-inf', '(' .. score)
local hi = lo + redis.call('ZCOUNT', queue, score, score)
local last = hi
while lo < hi do
  local mid = math.floor((lo + hi) / 2)
  if before_prefix(redis.call('ZRANGE', queue, mid, mid)[1]) then
    lo = mid + 1
  else
    hi = mid
  end
end
for rank = lo, math.min(last, lo + most) - 1 do
  local member = redis.call('ZRANGE', queue, rank, rank)[1]
  if string.sub(member, 1, #prefix) ~= prefix then
    return 0
  end
  if #member == size and redis.sha1hex(member) == digest then
    redis.call('ZREM', queue, member)
    return 1
  end
end
if lo + most < last then
  return -1
end
return 0

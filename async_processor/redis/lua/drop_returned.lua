-- Remove from its queue a completed message whose lease had lapsed (the reaper put it
-- back), known by its score, first bytes, size and SHA-1 only: the daemon lets a message's
-- bytes go once its request is written (docs/sizing-and-backpressure.md), and fetches only
-- a prefix of one over --max-message-bytes; the lease hash lost the member when the reaper
-- returned it.
-- KEYS[1] queue zset. ARGV[1] the member's score, ARGV[2] its first bytes, ARGV[3] its size,
-- ARGV[4] its SHA-1 (hex), ARGV[5] most members of that score and those first bytes still
-- to compare, ARGV[6] most member bytes this call reads, ARGV[7] where an earlier call
-- stopped: the next member's place among those of its score (0: this is the first call),
-- ARGV[8] the SHA-1 of the member before it (the last one that call compared).
-- Returns 1 when removed, 0 when not there (claimed again, answered, or never put back),
-- -1 when the comparisons ran out first, or the member before ARGV[7] is no longer there
-- (left to the dedup marker), or {place, SHA-1, compared} when this call's bytes ran out:
-- call again with them. Each member read is copied whole into Lua, and a member of its
-- size hashed: 400 look-alikes of 256 KiB blocked Redis for 265 ms in one call, so bytes,
-- not only a count, bound a call; between calls Redis serves the others.
-- Members of one score are ordered by their bytes, so the first one starting with ARGV[2]
-- is found by a binary search over ranks (ZRANGE by rank, O(log n) each): a thousand
-- messages sharing a deadline cost ~10 lookups, not a thousand comparisons.
expect_types(KEYS[1], 'zset')
local queue, score, prefix = KEYS[1], ARGV[1], ARGV[2]
local size, digest, most = tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local budget, place, before = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]

local function read(rank)
  local member = redis.call('ZRANGE', queue, rank, rank)[1]
  budget = budget - #member
  return member
end

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

local first = redis.call('ZCOUNT', queue, '-inf', '(' .. score)
local last = first + redis.call('ZCOUNT', queue, score, score)
local lo = first + place
if place > 0 then
  -- The next member in byte order after the last one compared, if that one is still
  -- where it was: members of this score added or removed before it moved it, and
  -- resuming by place could then skip one (ours, perhaps).
  if lo > last or redis.sha1hex(read(lo - 1)) ~= before then
    return -1
  end
else
  local hi = last
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if before_prefix(read(mid)) then
      lo = mid + 1
    else
      hi = mid
    end
  end
end
local stop = math.min(last, lo + most)
for rank = lo, stop - 1 do
  local member = read(rank)
  if string.sub(member, 1, #prefix) ~= prefix then
    return 0
  end
  if #member == size and redis.sha1hex(member) == digest then
    redis.call('ZREM', queue, member)
    return 1
  end
  if budget <= 0 and rank + 1 < stop then
    return {rank + 1 - first, redis.sha1hex(member), rank + 1 - lo}
  end
end
if stop < last then
  return -1
end
return 0

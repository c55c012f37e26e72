-- Claim up to ARGV[1] members with the lowest score (earliest deadline) under a lease.
-- KEYS[1] queue zset (member = envelope, score = deadline)
-- KEYS[2] in-flight zset (claim id -> lease expiry, Redis clock)
-- KEYS[3] in-flight hash (claim id -> "<original score>|<member>")
-- ARGV[1] max count, ARGV[2] lease seconds, ARGV[3] claim id prefix (unique per process and
-- fetch), ARGV[4] largest member (bytes) sent whole, ARGV[5] bytes sent of a larger one
-- Returns {claim id, member, score, size, sha1, ...}; {} when the queue is empty. A member
-- over ARGV[4] bytes comes as its first ARGV[5] bytes with its size and SHA-1 (sha1 is ""
-- for the others): the daemon answers or dead-letters it without receiving it.
expect_types(KEYS[1], 'zset', KEYS[2], 'zset', KEYS[3], 'hash')
local limit = tonumber(ARGV[1])
local whole, cut = tonumber(ARGV[4]), tonumber(ARGV[5])
local out = {}
local function emit(claim, member, score)
  local size, digest = #member, ''
  if size > whole then
    member, digest = string.sub(member, 1, cut), redis.sha1hex(member)
  end
  for _, value in ipairs({claim, member, score, size, digest}) do
    out[#out + 1] = value
  end
end
-- The same prefix again means the client retried a claim whose reply it never got (e.g.
-- Redis restarting): answer with that batch. Claiming anew would overwrite its claim ids
-- in the hash, and the members claimed the first time would be lost.
for i = 1, limit do
  local claim = ARGV[3] .. ':' .. i
  local entry = redis.call('HGET', KEYS[3], claim)
  if entry then  -- no early exit: the reaper may have taken back some of that batch
    local sep = string.find(entry, '|', 1, true)
    emit(claim, string.sub(entry, sep + 1), string.sub(entry, 1, sep - 1))
  end
end
if #out > 0 then
  return out
end
local popped = redis.call('ZPOPMIN', KEYS[1], limit)
if #popped == 0 then
  return popped
end
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2])
for i = 1, #popped, 2 do
  local claim = ARGV[3] .. ':' .. ((i + 1) / 2)
  redis.call('ZADD', KEYS[2], expiry, claim)
  redis.call('HSET', KEYS[3], claim, popped[i + 1] .. '|' .. popped[i])
  emit(claim, popped[i], popped[i + 1])
end
return out

-- Claim, for each of several queues, up to its count of members with the lowest score
-- (earliest deadline) under a lease: one call for a round of fetches (redis_fetch.py).
-- Per queue i: KEYS[3i-2] queue zset (member = envelope, score = deadline), KEYS[3i-1]
-- in-flight zset (claim id -> lease expiry, Redis clock), KEYS[3i] in-flight hash (claim
-- id -> "<original score>|<member>"); ARGV[2+2i] max count, ARGV[3+2i] claim id prefix
-- (unique per process and fetch).
-- ARGV[1] lease seconds, ARGV[2] largest member (bytes) sent whole, ARGV[3] bytes sent of
-- a larger one.
-- Returns one reply per queue: {claim id, member, score, size, sha1, ...} ({} when the
-- queue is empty), or the WRONGTYPE text of a queue whose keys have the wrong type: that
-- queue is left untouched, and the others are claimed (one queue's stray key must not stop
-- every tenant's fetches). A member over ARGV[2] bytes comes as its first ARGV[3] bytes with
-- its size and SHA-1 (sha1 is "" for the others): the daemon answers or dead-letters it
-- without receiving it.
local lease, whole, cut = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local expiry

local function claim_queue(queue, inflight, meta, limit, prefix)
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
    local claim = prefix .. ':' .. i
    local entry = redis.call('HGET', meta, claim)
    if entry then  -- no early exit: the reaper may have taken back some of that batch
      local sep = string.find(entry, '|', 1, true)
      emit(claim, string.sub(entry, sep + 1), string.sub(entry, 1, sep - 1))
    end
  end
  if #out > 0 then
    return out
  end
  local popped = redis.call('ZPOPMIN', queue, limit)
  if #popped > 0 and expiry == nil then
    local t = redis.call('TIME')
    expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + lease
  end
  for i = 1, #popped, 2 do
    local claim = prefix .. ':' .. ((i + 1) / 2)
    redis.call('ZADD', inflight, expiry, claim)
    redis.call('HSET', meta, claim, popped[i + 1] .. '|' .. popped[i])
    emit(claim, popped[i], popped[i + 1])
  end
  return out
end

local replies = {}
for q = 1, #KEYS / 3 do
  local queue, inflight, meta = KEYS[3 * q - 2], KEYS[3 * q - 1], KEYS[3 * q]
  -- Each queue's keys are checked before its own writes (the others' keys are distinct).
  if usable_as(queue, 'zset') and usable_as(inflight, 'zset') and usable_as(meta, 'hash') then
    replies[q] = claim_queue(queue, inflight, meta, tonumber(ARGV[2 + 2 * q]), ARGV[3 + 2 * q])
  else
    replies[q] = 'WRONGTYPE a key of queue ' .. queue .. ' has the wrong type'
  end
end
return replies

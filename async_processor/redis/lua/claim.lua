-- Claim, for each of several queues, up to its count of members with the lowest score
-- (earliest deadline), in upstream's claim layout (llm-d-async #412, shared with Go daemons
-- v0.9.1+): one call for a round of fetches (fetch.py).
-- Per queue i: KEYS[5i-4] queue zset (member = envelope, score = deadline), KEYS[5i-3]
-- <queue>:claimed (claim key -> member), KEYS[5i-2] <queue>:claim-owners (claim key ->
-- owner token), KEYS[5i-1] <queue>:claims-idx (claim key -> lease expiry, Unix seconds),
-- KEYS[5i] this fetch's claim record (claim-batch:<owner>:<n>); ARGV[4+i] its max count.
-- ARGV[1] lease seconds, ARGV[2] largest member (bytes) sent whole, ARGV[3] bytes sent of
-- a larger one, ARGV[4] this process's owner token (16 hex).
-- Claim key = data.id NUL internal.request_token (data.id alone without a token), as
-- upstream's; a member without a string id (which upstream drops, and we answer or
-- dead-letter) is keyed by its SHA-1, so it is still owned. Lease expiry = min(now + lease,
-- deadline + 300), as upstream's.
-- Returns one reply per queue: {claim key, member, score, size, sha1, ...} ({} when the
-- queue is empty), or the WRONGTYPE text of a queue whose keys have the wrong type (an
-- empty queue's claim keys are not looked at): that
-- queue is left untouched, and the others are claimed (one queue's stray key must not stop
-- every tenant's fetches). A member over ARGV[2] bytes comes as its first ARGV[3] bytes with
-- its size and SHA-1 (sha1 is "" for the others): the daemon answers or dead-letters it
-- without receiving it.
local lease, whole, cut = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local owner = ARGV[4]
local now

-- The claim key and the request's deadline (nil when it has none).
local function claim_key(member)
  local msg = envelope_of(member)
  local data = msg and msg['data']
  if type(data) ~= 'table' then
    data = msg
  end
  local id = data and data['id']
  if type(id) ~= 'string' then
    return redis.sha1hex(member), nil
  end
  local routing = msg['internal']
  local token = type(routing) == 'table' and routing['request_token']
  if type(token) == 'string' and token ~= '' then
    id = id .. '\0' .. token
  end
  return id, deadline_of(msg, nil)
end

local function claim_queue(queue, claimed, owners, idx, record, limit)
  local out = {}
  local function emit(key, member, score)
    local size, digest = #member, ''
    if size > whole then
      member, digest = string.sub(member, 1, cut), redis.sha1hex(member)
    end
    for _, value in ipairs({key, member, score, size, digest}) do
      out[#out + 1] = value
    end
  end
  -- The same record again means the client retried a claim whose reply it never got (e.g.
  -- Redis restarting): answer with that batch, the claims still ours. Claiming anew would
  -- leave the members claimed the first time in nobody's hands until their lease ran out.
  local wrong = 'WRONGTYPE a key of queue ' .. queue .. ' has the wrong type'
  -- Types are checked only where a claim is written or read back: a queue found empty
  -- (most calls, with several replicas at batch 1) costs no TYPE at all.
  local function usable()
    return usable_as(claimed, 'hash') and usable_as(owners, 'hash') and usable_as(idx, 'zset')
  end
  -- (pcall: a record key of another type is only overwritten, below, never read.)
  local seen = redis.pcall('GET', record)
  if type(seen) == 'string' then
    if not usable() then
      return wrong
    end
    for _, entry in ipairs(cjson.decode(seen)) do
      local member = redis.call('HGET', claimed, entry[1])
      if member and redis.call('HGET', owners, entry[1]) == owner then
        emit(entry[1], member, entry[2])
      end
    end
    return out
  end
  local lowest = redis.pcall('ZRANGE', queue, 0, limit - 1, 'WITHSCORES')
  if lowest['err'] ~= nil or (#lowest > 0 and not usable()) then
    return wrong
  end
  if #lowest == 0 then
    return out
  end
  if now == nil then
    now = server_now()
  end
  local kept = {}
  for i = 1, #lowest, 2 do
    local member, score = lowest[i], lowest[i + 1]
    local key, deadline = claim_key(member)
    local expiry = now + lease
    if deadline and deadline > 0 then
      expiry = math.min(expiry, deadline + 300)
    end
    redis.call('ZREM', queue, member)
    redis.call('HSET', claimed, key, member)
    redis.call('HSET', owners, key, owner)
    redis.call('ZADD', idx, expiry, key)
    kept[#kept + 1] = {key, score}
    emit(key, member, score)
  end
  redis.call('SET', record, cjson.encode(kept), 'EX', math.max(1, math.ceil(lease)))
  return out
end

local replies = {}
for q = 1, #KEYS / 5 do
  local k = 5 * q
  -- Each queue's keys are checked before its own writes (the others' keys are distinct).
  replies[q] = claim_queue(KEYS[k - 4], KEYS[k - 3], KEYS[k - 2], KEYS[k - 1], KEYS[k],
    tonumber(ARGV[4 + q]))
end
return replies

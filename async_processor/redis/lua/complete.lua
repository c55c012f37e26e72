-- Write the terminal results of a batch of messages and acknowledge each claim, in one
-- call: one script run per result batch (per hash slot in cluster mode), whatever the
-- number of queues in it, instead of one per result or per queue.
-- The ack is upstream's fenced ack (llm-d-async #412): a result is written only while
-- <queue>:claim-owners still names this process for the claim key; a stale owner (its
-- lease lapsed and the claim was reclaimed, perhaps claimed again by a Go daemon or
-- another replica) writes nothing and the message's next owner answers it.
-- Per item i (0-based), KEYS[12i+1..12i+12]: dedup marker (request-done:<id>:<digest>),
-- result list, <queue>:claimed, <queue>:claim-owners, <queue>:claims-idx,
-- request-active:<id>, request-cancel:<id>, fallback result list (the transport's
-- default), <queue>:live:<id> (the client's idempotency marker: the id is free again), the
-- results-pushed counters of the result list and of the fallback list (retention:
-- incremented only once retain.lua made them), and request-payload:<id>:<token> (the body
-- stored apart, upstream's payload key: deleted with the result when the item's ARGV says
-- so; any key of the item's slot otherwise).
-- ARGV[1] marker TTL seconds, ARGV[2] "claim", or "queued": then each item's claimed key
-- is the request queue and its claim key a member of it (the deadline sweep), answered
-- only while still queued, since another replica's claim or sweep may have taken it since
-- it was read. ARGV[3] this process's owner token. Per item, ARGV[4i+4..4i+7]: claim key
-- (or member), encoded result, request token, "1" to delete the payload key.
-- Returns, per item, {1 if the result was written (0 = already done, or not ours), 1 if
-- the claim was still ours (or the member still queued), 1 if its result list was not a
-- list and the result went to the fallback}, or the WRONGTYPE text of an item one of whose
-- keys has the wrong type: that item is left untouched and the others are written (one
-- queue's stray key must not stop every tenant's results, as in claim.lua). Every key an
-- item writes with a type-bound command is checked before the first write, so the cached
-- types stay valid and a failing item changes nothing; the string keys are not checked
-- (a TYPE each was a fifth of a message's commands): the marker is set whatever it held,
-- and a marker of another type read with pcall is simply not this submission's.
local items = #KEYS / 12
local queued, owner = ARGV[2] == 'queued', ARGV[3]
local targets, pushed, fell_back, failed = {}, {}, {}, {}

local function check(i)
  local k = 12 * i
  -- The result list may come from the message (result_queue_name): a key of another type
  -- is not written to, the result goes to the configured list instead.
  targets[i], pushed[i], fell_back[i] = KEYS[k + 2], KEYS[k + 10], 0
  if not usable_as(targets[i], 'list') then
    targets[i], pushed[i], fell_back[i] = KEYS[k + 8], KEYS[k + 11], 1
  end
  expect_types(targets[i], 'list', KEYS[k + 3], queued and 'zset' or 'hash',
    KEYS[k + 4], 'hash', KEYS[k + 5], 'zset')
end

for i = 0, items - 1 do
  local ok, err = pcall(check, i)
  if not ok then
    failed[i] = type(err) == 'table' and err.err or tostring(err)
  end
end

-- Fenced: the claim leaves only while it is ours (or the member while it is queued).
local function ack(k, key)
  if queued then
    return redis.call('ZREM', KEYS[k + 3], key) == 1
  end
  if owner == '' or redis.call('HGET', KEYS[k + 4], key) ~= owner then
    return false
  end
  redis.call('HDEL', KEYS[k + 3], key)
  redis.call('HDEL', KEYS[k + 4], key)
  redis.call('ZREM', KEYS[k + 5], key)
  return true
end

local function complete_one(i)
  local k, a = 12 * i, 4 * i + 3
  if not ack(k, ARGV[a + 1]) then
    return {0, 0, fell_back[i]}
  end
  local written = 0
  if redis.call('EXISTS', KEYS[k + 1]) == 0 then
    redis.call('LPUSH', targets[i], ARGV[a + 2])
    -- Counted for result retention, only for a retained list: its counter is created by
    -- lua/retain.lua, which runs for the configured lists; a list a message names gets
    -- no counter of ours. A counter name taken by another key (a message may name any
    -- list) only stops the counting: pcall, as the result is already written.
    if redis.call('TYPE', pushed[i])['ok'] == 'string' then
      redis.pcall('INCR', pushed[i])
    end
    redis.call('SET', KEYS[k + 1], '1', 'EX', tonumber(ARGV[1]))
    written = 1
  end
  -- The reference's cleanup: drop the markers only while they belong to this submission.
  local token = ARGV[a + 3]
  if token ~= '' then
    for _, key in ipairs({KEYS[k + 6], KEYS[k + 7], KEYS[k + 9]}) do
      if redis.pcall('GET', key) == token then
        redis.call('DEL', key)
      end
    end
  end
  if ARGV[a + 4] == '1' then
    redis.call('DEL', KEYS[k + 12])
  end
  return {written, 1, fell_back[i]}
end

local replies = {}
for i = 0, items - 1 do
  replies[i + 1] = failed[i] or complete_one(i)
end
return replies

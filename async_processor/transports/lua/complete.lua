-- Write one terminal result and acknowledge its claim, atomically.
-- KEYS[1] dedup marker (request-done:<id>:<digest>), KEYS[2] result list,
-- KEYS[3] in-flight zset, KEYS[4] in-flight hash, KEYS[5] request-active:<id>,
-- KEYS[6] request-cancel:<id>, KEYS[7] fallback result list (the transport's default),
-- KEYS[8] <queue>:live:<id> (the client's idempotency marker: the id is free again),
-- KEYS[9], KEYS[10] the results-pushed counters of KEYS[2] and KEYS[7] (retention)
-- ARGV[1] claim id, ARGV[2] encoded result, ARGV[3] marker TTL seconds, ARGV[4] request
-- token, ARGV[5] "claim", or "queued": then KEYS[3] is the request queue and ARGV[1] a
-- member of it (the deadline sweep), answered only while still queued, since another
-- replica's claim or sweep may have taken it since it was read.
-- Returns {1 if the result was written (0 = already done), 1 if the claim was still held,
-- 1 if KEYS[2] was not a list and the result went to KEYS[7]}.
-- Every type is checked before the first write, so a failure changes nothing.
local fell_back = 0
local target = KEYS[2]
-- KEYS[2] may come from the message (result_queue_name): a key of another type is not
-- written to, the result goes to the configured list instead.
local pushed = KEYS[9]
if not usable_as(target, 'list') then
  target, fell_back, pushed = KEYS[7], 1, KEYS[10]
end
expect_types(target, 'list', KEYS[1], 'string', KEYS[3], 'zset', KEYS[4], 'hash',
  KEYS[5], 'string', KEYS[6], 'string', KEYS[8], 'string')
if ARGV[5] == 'queued' and not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  return {0, 0, 0}
end
local written = 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('LPUSH', target, ARGV[2])
  -- Counted for result retention (lua/retain.lua); a counter name taken by a key of
  -- another type (a message may name any list) only stops the counting.
  if usable_as(pushed, 'string') then
    redis.call('INCR', pushed)
  end
  redis.call('SET', KEYS[1], '1', 'EX', tonumber(ARGV[3]))
  written = 1
end
local held = redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
-- The reference's cleanup: drop the markers only while they belong to this submission.
if ARGV[4] ~= '' then
  for _, key in ipairs({KEYS[5], KEYS[6], KEYS[8]}) do
    if redis.call('GET', key) == ARGV[4] then
      redis.call('DEL', key)
    end
  end
end
return {written, held, fell_back}

-- Write one terminal result and acknowledge its claim, atomically.
-- KEYS[1] dedup marker (request-done:<id>:<token or fingerprint>), KEYS[2] result list,
-- KEYS[3] in-flight zset, KEYS[4] in-flight hash, KEYS[5] request-active:<id>,
-- KEYS[6] request-cancel:<id>, KEYS[7] fallback result list (the transport's default)
-- ARGV[1] claim id, ARGV[2] encoded result, ARGV[3] marker TTL seconds, ARGV[4] request token
-- Returns {1 if the result was written (0 = already done), 1 if the claim was still held,
-- 1 if KEYS[2] was unusable and the result went to KEYS[7]}.
-- The result is pushed first: a script that fails part-way keeps what it already wrote, so
-- nothing is acknowledged or marked done unless the result landed.
local written, fell_back = 0, 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  -- KEYS[2] comes from the message (result_queue_name) and may name a key of another type.
  local pushed = redis.pcall('LPUSH', KEYS[2], ARGV[2])
  if type(pushed) == 'table' and pushed.err then
    redis.call('LPUSH', KEYS[7], ARGV[2])
    fell_back = 1
  end
  redis.call('SET', KEYS[1], '1', 'EX', tonumber(ARGV[3]))
  written = 1
end
local held = redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
-- The reference's cleanup: drop the markers only while they belong to this submission.
if ARGV[4] ~= '' then
  for _, key in ipairs({KEYS[5], KEYS[6]}) do
    if redis.call('GET', key) == ARGV[4] then
      redis.call('DEL', key)
    end
  end
end
return {written, held, fell_back}

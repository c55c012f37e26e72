-- Write one terminal result and acknowledge its claim, atomically.
-- KEYS[1] dedup marker (request-done:<id>:<token or fingerprint>), KEYS[2] result list,
-- KEYS[3] in-flight zset, KEYS[4] in-flight hash, KEYS[5] request-active:<id>,
-- KEYS[6] request-cancel:<id>
-- ARGV[1] claim id, ARGV[2] encoded result, ARGV[3] marker TTL seconds, ARGV[4] request token
-- Returns {1 if the result was written (0 = already done), 1 if the claim was still held}.
local held = redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
local written = 0
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[3])) then
  redis.call('LPUSH', KEYS[2], ARGV[2])
  written = 1
end
-- The reference's cleanup: drop the markers only while they belong to this submission.
if ARGV[4] ~= '' then
  for _, key in ipairs({KEYS[5], KEYS[6]}) do
    if redis.call('GET', key) == ARGV[4] then
      redis.call('DEL', key)
    end
  end
end
return {written, held}

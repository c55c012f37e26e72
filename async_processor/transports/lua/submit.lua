-- Submit one request unless its id is live: clear an old cancellation, mark it active,
-- queue it in order.
-- KEYS[1] queue zset, KEYS[2] request-active:<id>, KEYS[3] request-cancel:<id>,
-- KEYS[4] <queue>:seq:<deadline> (submissions so far with this deadline),
-- KEYS[5] <queue>:live:<id> (the live submission's token: the queue's id index)
-- ARGV[1] envelope, ARGV[2] deadline (integer Unix seconds), ARGV[3] token,
-- ARGV[4] marker TTL seconds, ARGV[5] live marker TTL seconds
-- Returns {1, token} when queued; {0, live token} when the id already has a submission on
-- this queue (queued, in flight or retrying: the result's write deletes the marker, else
-- it expires a grace period after the deadline): the id is not queued twice.
-- The score is the deadline plus n * 2^-20 for the n-th submission with that deadline:
-- its integer part is still the deadline (what other producers and the reaper see), and
-- equal deadlines come out in submission order (ZPOPMIN) instead of by member bytes.
-- Past 2^20 - 1 submissions of one deadline (or a deadline from 2106 on, where a double
-- has no room for the fraction) the score is the bare deadline.
expect_types(KEYS[1], 'zset', KEYS[2], 'string', KEYS[3], 'string', KEYS[4], 'string',
  KEYS[5], 'string')
local live = redis.call('GET', KEYS[5])
if live then
  return {0, live}
end
local deadline = tonumber(ARGV[2])
local n = redis.call('INCR', KEYS[4])
redis.call('EXPIREAT', KEYS[4], deadline + 60)
local score = deadline
if n < 1048576 and deadline < 4294967296 then
  score = deadline + n / 1048576
end
redis.call('DEL', KEYS[3])
redis.call('SET', KEYS[2], ARGV[3], 'EX', tonumber(ARGV[4]))
redis.call('SET', KEYS[5], ARGV[3], 'EX', tonumber(ARGV[5]))
-- %.17g: Lua would print the number with 14 digits only, losing the fraction.
redis.call('ZADD', KEYS[1], string.format('%.17g', score), ARGV[1])
return {1, ARGV[3]}

-- Submit one request unless its id is live on this queue: mark it active, queue it in
-- order.
-- KEYS[1] queue zset, KEYS[2] request-active:<id>,
-- KEYS[3] <queue>:seq:<deadline> (submissions so far with this deadline),
-- KEYS[4] <queue>:live:<id> (the live submission's token: the queue's id index)
-- ARGV[1] envelope, ARGV[2] deadline (integer Unix seconds), ARGV[3] token,
-- ARGV[4] marker TTL seconds, ARGV[5] live marker TTL seconds, ARGV[6] counter TTL seconds
-- Returns {1, token} when queued; {0, live token} when the id already has a submission on
-- this queue (queued, in flight or retrying: the result's write deletes the marker, else
-- it expires a grace period after the deadline): the id is not queued twice.
-- request-cancel:<id> is left alone: whatever token it holds is a submission's that may
-- still be live (another queue's, or one written around the index), and a fresh token
-- never matches it.
-- The score is the deadline plus n * 2^-20 for the n-th submission with that deadline:
-- its integer part is still the deadline (what other producers and the reaper see), and
-- equal deadlines come out in submission order (ZPOPMIN) instead of by member bytes.
-- Past 2^20 - 1 submissions of one deadline the fraction stays at its largest, so later
-- ones still sort after earlier ones (byte order among themselves). From 2106 on (a
-- deadline >= 2^32, where a double has no room for the fraction) the score is the bare
-- deadline and no counter is made. The counter lives ARGV[6] s past its last use.
expect_types(KEYS[1], 'zset', KEYS[2], 'string', KEYS[3], 'string', KEYS[4], 'string')
local live = redis.call('GET', KEYS[4])
if live then
  return {0, live}
end
local deadline = tonumber(ARGV[2])
local score = deadline
if deadline < 4294967296 then
  local n = redis.call('INCR', KEYS[3])
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[6]))
  score = deadline + math.min(n, 1048575) / 1048576
end
redis.call('SET', KEYS[2], ARGV[3], 'EX', tonumber(ARGV[4]))
redis.call('SET', KEYS[4], ARGV[3], 'EX', tonumber(ARGV[5]))
-- %.17g: Lua would print the number with 14 digits only, losing the fraction.
redis.call('ZADD', KEYS[1], string.format('%.17g', score), ARGV[1])
return {1, ARGV[3]}

-- Submit one request unless its id is live on this queue: mark it active, queue it in
-- order.
-- KEYS[1] queue zset, KEYS[2] request-active:<id>,
-- KEYS[3] request-seq:<queue>:<deadline> (upstream's counter of submissions with this
-- deadline, shared with Go producers), KEYS[4] <queue>:live:<id> (the live submission's
-- token: the queue's id index)
-- ARGV[1] envelope, ARGV[2] deadline (integer Unix seconds), ARGV[3] token,
-- ARGV[4] marker TTL seconds, ARGV[5] live marker TTL seconds, ARGV[6] counter expiry
-- (Unix seconds: the deadline + an hour, as upstream)
-- With payload keys (upstream's WithPayloadKeys(), the envelope has payload_ref and no
-- payload): KEYS[5] request-payload:<id>:<token>, ARGV[7] the payload, ARGV[8] its TTL in
-- ms (the time to the deadline + 10 minutes), written with the envelope.
-- Returns {1, token} when queued; {0, live token} when the id already has a submission on
-- this queue (queued, in flight or retrying: the result's write deletes the marker, else
-- it expires a grace period after the deadline): the id is not queued twice.
-- request-cancel:<id> is left alone: whatever token it holds is a submission's that may
-- still be live (another queue's, or one written around the index), and a fresh token
-- never matches it.
-- Upstream's submission order (llm-d-async #463): the envelope carries the placeholder
-- "enqueue_seq":-1 in its routing (the first key of the envelope, so the first match is
-- it: a string holding those bytes escapes its quotes), replaced by n, the n-th
-- submission of this deadline to this queue; the score is deadline + min(n, 2^21 - 1) /
-- 2^21: its integer part is still the deadline (what other producers and the reaper
-- see), and equal deadlines come out in submission order, whichever producer (Go or this
-- library) wrote them. An envelope without the placeholder (a deadline from 2106 on,
-- where a double has no room for the fraction) is scored by its bare deadline.
expect_types(KEYS[1], 'zset', KEYS[2], 'string', KEYS[3], 'string', KEYS[4], 'string')
if KEYS[5] then
  expect_types(KEYS[5], 'string')
end
local live = redis.call('GET', KEYS[4])
if live then
  return {0, live}
end
local deadline = tonumber(ARGV[2])
local member, score = ARGV[1], deadline
local at = string.find(member, '"enqueue_seq":-1', 1, true)
if at then
  local n = redis.call('INCR', KEYS[3])
  redis.call('EXPIREAT', KEYS[3], tonumber(ARGV[6]))
  member = string.sub(member, 1, at + 13) .. n .. string.sub(member, at + 16)
  score = deadline + math.min(n, 2097151) / 2097152
end
redis.call('SET', KEYS[2], ARGV[3], 'EX', tonumber(ARGV[4]))
redis.call('SET', KEYS[4], ARGV[3], 'EX', tonumber(ARGV[5]))
if KEYS[5] then
  redis.call('SET', KEYS[5], ARGV[7], 'PX', tonumber(ARGV[8]))
end
-- %.17g: Lua would print the number with 14 digits only, losing the fraction.
redis.call('ZADD', KEYS[1], string.format('%.17g', score), member)
return {1, ARGV[3]}

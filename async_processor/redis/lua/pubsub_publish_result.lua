-- One result per submission: publish only if this call sets the dedup marker.
-- KEYS[1] marker; ARGV[1] channel, ARGV[2] result, ARGV[3] marker TTL.
-- Returns the number of receivers, or -1 when a result was already published.
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[3])) then
  return -1
end
return redis.call('PUBLISH', ARGV[1], ARGV[2])

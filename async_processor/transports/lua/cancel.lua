-- Mark a submitted request cancelled: copy its active token to the cancel marker.
-- KEYS[1] request-active:<id>, KEYS[2] request-cancel:<id>; ARGV[1] marker TTL seconds
-- Returns 1 when marked, 0 for an unknown or finished request (idempotent).
expect_types(KEYS[1], 'string', KEYS[2], 'string')
local token = redis.call('GET', KEYS[1])
if not token then
  return 0
end
redis.call('SET', KEYS[2], token, 'EX', tonumber(ARGV[1]))
return 1

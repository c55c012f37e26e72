-- Mark one queue's submission of an id cancelled: copy its token to the cancel marker.
-- KEYS[1] request-active:<id>, KEYS[2] request-cancel:<id>, KEYS[3] <queue>:live:<id>
-- (the queue's id index); ARGV[1] marker TTL seconds
-- The token is the queue's own live submission's (the index). Without one, the id's
-- latest submission anywhere (request-active:<id>, as the Go producer's cancel reads it),
-- unless that token was made by the client library: such a submission has an index entry
-- on its own queue, so it is another queue's, which this cancel must not reach.
-- Returns the token marked, or 0 for an unknown or finished request (idempotent).
-- A client-library token (client.new_token): 16 hex, then the first 16 hex of the SHA-1
-- of 'async-processor:' and those 16. Another producer's random token matches by chance
-- with odds 2^-64.
local function client_token(token)
  local head = string.sub(token, 1, 16)
  return #token == 32 and
    string.sub(redis.sha1hex('async-processor:' .. head), 1, 16) == string.sub(token, 17)
end

expect_types(KEYS[1], 'string', KEYS[2], 'string', KEYS[3], 'string')
local token = redis.call('GET', KEYS[3])
if not token then
  token = redis.call('GET', KEYS[1])
  if not token or client_token(token) then
    return 0
  end
end
redis.call('SET', KEYS[2], token, 'EX', tonumber(ARGV[1]))
return token

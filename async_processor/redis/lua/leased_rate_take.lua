-- redis-leased-rate: check the lease, then take a token from the shared bucket.
-- KEYS control, state; ARGV api_version, pool_id, burst_seconds.
-- Returns {allowed 0/1, lease valid 0/1, rps text, valid_until_ms text}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('HMGET', KEYS[1], 'api_version', 'pool_id', 'max_admission_rps',
                     'valid_until_unix_ms', 'decision_id')
local rate, untl = tonumber(r[3]), tonumber(r[4])
if r[1] ~= ARGV[1] or r[2] ~= ARGV[2] or not rate or rate ~= rate or rate < 0
   or rate == math.huge or not untl or not string.match(r[4], '^%d+$') or untl <= now
   or not r[5] or r[5] == '' then
  return {0, 0, '', ''}
end
if rate == 0 then return {0, 1, r[3], r[4]} end
local cap = math.max(1, rate * tonumber(ARGV[3]))
local s = redis.call('HMGET', KEYS[2], 'tokens', 'last_ms')
local tokens, last = tonumber(s[1]), tonumber(s[2])
if not tokens or not last then tokens, last = cap, now end
if last > now then last = now end
tokens = math.min(cap, tokens + (now - last) / 1000 * rate)
local allowed = 0
if tokens >= 1 then tokens = tokens - 1; allowed = 1 end
redis.call('HSET', KEYS[2], 'tokens', string.format('%.6f', tokens),
           'last_ms', string.format('%d', now))
redis.call('PEXPIRE', KEYS[2], math.max(1000, untl - now + 1000))
return {allowed, 1, r[3], r[4]}

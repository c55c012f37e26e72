-- The idle-queue probe (redis_fetch.py): which of KEYS (queue sorted sets) hold anything.
-- An empty sorted set does not exist in Redis, so EXISTS answers exactly what a claim's
-- ZPOPMIN would find; a key of another type counts as ready, so its claim reports it.
-- Returns the 1-based indexes of the keys that exist. Read only.
local out = {}
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    out[#out + 1] = i
  end
end
return out

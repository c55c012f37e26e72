-- Renew the leases of claims this process holds, for several queues in one call (all in
-- one slot in cluster mode): the heartbeat's one call per slot group, not one per claim
-- (upstream renews each claim with its own script). Fenced as upstream's renew: a claim
-- whose owner is no longer this process (reclaimed and claimed by another, Go or ours) or
-- that is gone is not touched, and reported lost.
-- Per queue i: KEYS[2i-1] <queue>:claim-owners, KEYS[2i] <queue>:claims-idx. ARGV[1] lease
-- seconds, ARGV[2] owner token; then, per queue in KEYS order, the count n of its claims
-- followed by n pairs (claim key, latest expiry: its deadline + 300, as upstream caps it).
-- Returns per queue the claim keys no longer held, or the WRONGTYPE text of a queue whose
-- claim keys have the wrong type: that queue is left alone, the others are renewed.
local expiry = server_now() + tonumber(ARGV[1])
local owner = ARGV[2]
local replies = {}
local at = 3
for q = 1, #KEYS / 2 do
  local owners, idx = KEYS[2 * q - 1], KEYS[2 * q]
  local n = tonumber(ARGV[at])
  if usable_as(owners, 'hash') and usable_as(idx, 'zset') then
    local lost = {}
    for i = at + 1, at + 2 * n, 2 do
      if redis.call('HGET', owners, ARGV[i]) == owner then
        redis.call('ZADD', idx, math.min(expiry, tonumber(ARGV[i + 1])), ARGV[i])
      else
        lost[#lost + 1] = ARGV[i]
      end
    end
    replies[q] = lost
  else
    replies[q] = 'WRONGTYPE a claim key of ' .. idx .. ' has the wrong type'
  end
  at = at + 2 * n + 1
end
return replies

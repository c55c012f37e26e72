-- Replay one entry if it is still on the list. KEYS[1] dead-letter list, KEYS[2] the queue
-- (sorted set) or channel; ARGV[1] the entry, ARGV[2] the message, ARGV[3] its score,
-- ARGV[4] "zadd" or "publish". Returns 1 replayed, 0 no longer listed, -1 no subscriber.
if not redis.call('LPOS', KEYS[1], ARGV[1]) then return 0 end
if ARGV[4] == 'publish' then
  if redis.call('PUBLISH', KEYS[2], ARGV[2]) == 0 then return -1 end
else
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
end
redis.call('LREM', KEYS[1], 1, ARGV[1])
return 1

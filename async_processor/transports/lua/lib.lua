-- Prepended to every script (redis_keys.script_source). Redis does not roll a script back,
-- so each script calls expect_types on every key it touches BEFORE its first write: a key
-- of the wrong type then fails the whole call with nothing changed, instead of leaving a
-- half-done step (e.g. members popped from a queue but never recorded as in flight).
-- Arguments: key, type, key, type, ... ; 'none' (missing key) is always accepted.
local function expect_types(...)
  local pairs_ = {...}
  for i = 1, #pairs_, 2 do
    local actual = redis.call('TYPE', pairs_[i])['ok']
    if actual ~= 'none' and actual ~= pairs_[i + 1] then
      error(redis.error_reply('WRONGTYPE key ' .. pairs_[i] .. ' is a ' .. actual ..
        ', expected a ' .. pairs_[i + 1]))
    end
  end
end

-- True when the key is missing or of the given type (for keys with a fallback).
local function usable_as(key, kind)
  local actual = redis.call('TYPE', key)['ok']
  return actual == 'none' or actual == kind
end

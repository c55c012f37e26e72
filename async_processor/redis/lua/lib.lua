-- Prepended to every script (redis_keys.script_source). Redis does not roll a script back,
-- so each script calls expect_types on every key it touches BEFORE its first write: a key
-- of the wrong type then fails the whole call with nothing changed, instead of leaving a
-- half-done step (e.g. members popped from a queue but never recorded as in flight). A key
-- only read may instead be told by its read's own WRONGTYPE (redis.pcall), still before
-- the first write; a script covering many queues may fail one queue's part alone.
-- Arguments: key, type, key, type, ... ; 'none' (missing key) is always accepted.
-- The types seen by the checks, asked once per key and call: a batch names the same result
-- list and in-flight keys for every item. Valid only before the script's first write.
local checked_types = {}
local function checked_type(key)
  local known = checked_types[key]
  if known == nil then
    known = redis.call('TYPE', key)['ok']
    checked_types[key] = known
  end
  return known
end

local function expect_types(...)
  local pairs_ = {...}
  for i = 1, #pairs_, 2 do
    local actual = checked_type(pairs_[i])
    if actual ~= 'none' and actual ~= pairs_[i + 1] then
      error(redis.error_reply('WRONGTYPE key ' .. pairs_[i] .. ' is a ' .. actual ..
        ', expected a ' .. pairs_[i + 1]))
    end
  end
end

-- True when the key is missing or of the given type (for keys with a fallback); before
-- the first write, like expect_types.
local function usable_as(key, kind)
  local actual = checked_type(key)
  return actual == 'none' or actual == kind
end

-- Redis's clock in Unix seconds with its microseconds: every lease, due time and expiry
-- a script compares or writes is on this one clock, never a daemon's.
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- A member's envelope as a table, or nil for bytes that are not a JSON object.
-- cjson refuses a lone surrogate escape ("\ud800"), which JSON and the daemon accept (a
-- payload passes through verbatim): read again with every surrogate escape as "?", since
-- only the routing and the deadline are read here, never the payload.
local function envelope_of(member)
  local ok, msg = pcall(cjson.decode, member)
  if not ok then
    ok, msg = pcall(cjson.decode, (string.gsub(member, '\\u[dD][89a-fA-F]%x%x', '\\u003f')))
  end
  if ok and type(msg) == 'table' then
    return msg
  end
  return nil
end

-- The request's deadline, from an envelope ({data = request}) or a bare request, else
-- fallback: a message going back to its queue is scored by its deadline, as producers do.
local function deadline_of(msg, fallback)
  if msg == nil then
    return fallback
  end
  local data = msg['data']
  if type(data) ~= 'table' then
    data = msg
  end
  if type(data['deadline']) == 'number' then
    return data['deadline']
  end
  return fallback
end

-- The score a message goes back to its queue with, as text: its deadline plus upstream's
-- submission-order fraction (internal.enqueue_seq, llm-d-async #463: the n-th of its
-- deadline scores deadline + min(n, 2^21 - 1) / 2^21), so a retried message keeps its
-- place among equal deadlines; fallback (a number) without a deadline. %.17g: Lua's own
-- number text has 14 digits, which would cut the fraction.
local function queue_score(msg, fallback)
  local score = deadline_of(msg, nil)
  if score == nil then
    return string.format('%.17g', fallback)
  end
  local routing = msg['internal']
  local seq = type(routing) == 'table' and routing['enqueue_seq']
  if type(seq) == 'number' and seq >= 1 and score < 4294967296 then
    score = score + math.min(math.floor(seq), 2097151) / 2097152
  end
  return string.format('%.17g', score)
end

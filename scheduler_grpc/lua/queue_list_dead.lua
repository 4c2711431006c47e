-- KEYS[1]=dead KEYS[2]=priority KEYS[3]=data KEYS[4]=deliveries KEYS[5]=dead_reason
-- ARGV[1]=page size ARGV[2]=parked time (ms) of the last item already seen, '' for the first page
-- ARGV[3]=id of the last item already seen ('' for the first page)
-- Returns: {more, id, parked_ms, reason, priority, deliveries, data, id, ...}: up to page size dead
-- items after the given one in (time parked, id) order; more = 1 when further items follow.
local dead_key, priority_key, data_key, deliveries_key, dead_reason_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local size = tonumber(ARGV[1])

-- Byte order, as Redis orders members of equal score. Lua's own '<' on strings uses strcoll, which
-- follows the server's locale, so it is not used.
local function bytes_le(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x < y
    end
  end
  return #a <= #b
end

local start = 0
if ARGV[2] ~= '' then
  local after_ms, after_id = tonumber(ARGV[2]), ARGV[3]
  local score = redis.call('ZSCORE', dead_key, after_id)
  if score and tonumber(score) == after_ms then
    -- The usual case: the last item seen is still parked, so its rank is where the page starts.
    start = redis.call('ZRANK', dead_key, after_id) + 1
  else
    -- It left meanwhile: skip everything parked earlier, then the same-millisecond items that sort
    -- at or before it. Only items parked in that one millisecond are scanned.
    start = redis.call('ZCOUNT', dead_key, '-inf', '(' .. ARGV[2])
    local scanning = true
    while scanning do
      local chunk = redis.call('ZRANGE', dead_key, start, start + 99, 'WITHSCORES')
      if #chunk == 0 then
        break
      end
      for i = 1, #chunk, 2 do
        if tonumber(chunk[i + 1]) == after_ms and bytes_le(chunk[i], after_id) then
          start = start + 1
        else
          scanning = false
          break
        end
      end
    end
  end
end

-- One extra entry tells whether another page follows.
local entries = redis.call('ZRANGE', dead_key, start, start + size, 'WITHSCORES')
local out = {0}
local last = math.min(#entries, size * 2)
if #entries > size * 2 then
  out[1] = 1
end
for i = 1, last, 2 do
  local id = entries[i]
  out[#out + 1] = id
  out[#out + 1] = entries[i + 1]
  out[#out + 1] = redis.call('HGET', dead_reason_key, id) or ''
  out[#out + 1] = redis.call('HGET', priority_key, id) or '0'
  out[#out + 1] = redis.call('HGET', deliveries_key, id) or '0'
  out[#out + 1] = redis.call('HGET', data_key, id) or ''
end
return out

-- KEYS[1]=dead KEYS[2]=priority KEYS[3]=data KEYS[4]=dead_reason
-- ARGV: four per item: ARGV[4i+1]=id ARGV[4i+2]=priority ARGV[4i+3]=data ('' stores nothing)
--       ARGV[4i+4]=reason; items are parked now (Redis clock)
-- Returns: the number of items parked. An id the queue already knows, in any state, is skipped, so
-- a rebuild of the dead set from PostgreSQL never touches an item Redis still has.
local dead_key, priority_key, data_key, dead_reason_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]

local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local parked = 0
for i = 1, #ARGV, 4 do
  local id = ARGV[i]
  -- The priority hash doubles as the set of known ids (as in enqueue).
  if redis.call('HSETNX', priority_key, id, ARGV[i + 1]) == 1 then
    if ARGV[i + 2] ~= '' then
      redis.call('HSET', data_key, id, ARGV[i + 2])
    end
    redis.call('ZADD', dead_key, now, id)
    redis.call('HSET', dead_reason_key, id, ARGV[i + 3])
    parked = parked + 1
  end
end
return parked

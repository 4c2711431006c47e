-- KEYS[1]=dead KEYS[2]=priority KEYS[3]=data KEYS[4]=dead_reason KEYS[5]=lims
-- ARGV: five per item: id, priority, data ('' stores nothing), reason, group (its limit keys, see
-- _groups.lua; '' for none); items are parked now (Redis clock)
-- Returns: the number of items parked. An id the queue already knows, in any state, is skipped, so
-- a rebuild of the dead set from PostgreSQL never touches an item Redis still has.
local dead_key, priority_key, data_key, dead_reason_key, lims_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local parked = 0
for i = 1, #ARGV, 5 do
  local id = ARGV[i]
  -- The priority hash doubles as the set of known ids (as in enqueue).
  if redis.call('HSETNX', priority_key, id, ARGV[i + 1]) == 1 then
    if ARGV[i + 2] ~= '' then
      redis.call('HSET', data_key, id, ARGV[i + 2])
    end
    redis.call('ZADD', dead_key, now, id)
    redis.call('HSET', dead_reason_key, id, ARGV[i + 3])
    if ARGV[i + 4] ~= '' then
      redis.call('HSET', lims_key, id, ARGV[i + 4])
    end
    parked = parked + 1
  end
end
return parked

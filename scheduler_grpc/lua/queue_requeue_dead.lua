-- KEYS[1]=dead KEYS[2]=ready KEYS[3]=priority KEYS[4]=deliveries KEYS[5]=dead_reason KEYS[6]=seq
-- KEYS[7]=marker
-- ARGV[1]=most items to move ARGV[2..]=ids to requeue; with none, the earliest parked items
-- Returns: the ids moved from dead back to ready (priority kept, deliveries reset, joining the back
-- of their priority); ids not in the dead set are skipped.
local dead_key, ready_key, priority_key, deliveries_key, dead_reason_key, seq_key, marker_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]

-- @include ready_score

local limit = tonumber(ARGV[1])
local candidates = {}
if #ARGV > 1 then
  -- A copy by index: unpack() would overflow the Lua stack on a few thousand ids.
  for i = 2, math.min(#ARGV, limit + 1) do
    candidates[#candidates + 1] = ARGV[i]
  end
else
  candidates = redis.call('ZRANGE', dead_key, 0, limit - 1)
end

local moved = {}
for _, id in ipairs(candidates) do
  if redis.call('ZREM', dead_key, id) == 1 then
    redis.call('HDEL', dead_reason_key, id)
    redis.call('HDEL', deliveries_key, id)
    local priority = tonumber(redis.call('HGET', priority_key, id) or '0')
    redis.call('ZADD', ready_key, ready_score(priority), id)
    moved[#moved + 1] = id
  end
end
if #moved > 0 then
  redis.call('ZADD', marker_key, 0, 'ready')
end
return moved

-- KEYS[1]=dead KEYS[2]=ready KEYS[3]=priority KEYS[4]=deliveries KEYS[5]=dead_reason KEYS[6]=seq
-- KEYS[7]=marker KEYS[8]=lims KEYS[9]=gwait KEYS[10]=gmem KEYS[11]=gactive KEYS[12]=gdelay
-- KEYS[13]=gblock KEYS[14]=grr KEYS[15]=kpark KEYS[16]=kqueued KEYS[17]=held KEYS[18]=holds
-- ARGV[1]=most items to move ARGV[2..]=ids to requeue; with none, the earliest parked items
-- Returns: the ids moved from dead back to ready (priority kept, deliveries reset, joining the back
-- of their priority); ids not in the dead set are skipped. An item with limit keys goes back to its
-- group's backlog rather than to ready (see _groups.lua).
local dead_key, ready_key, priority_key, deliveries_key, dead_reason_key, seq_key, marker_key, lims_key,
  gwait_key, gmem_key, gactive_key, gdelay_key, gblock_key, grr_key, kpark_key, kqueued_key, held_key,
  holds_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18]

-- @include ready_score
-- @include groups

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
local wake = false
for _, id in ipairs(candidates) do
  if redis.call('ZREM', dead_key, id) == 1 then
    redis.call('HDEL', dead_reason_key, id)
    redis.call('HDEL', deliveries_key, id)
    local priority = tonumber(redis.call('HGET', priority_key, id) or '0')
    if make_ready(id, priority) then
      wake = true
    end
    moved[#moved + 1] = id
  end
end
if wake then
  redis.call('ZADD', marker_key, 0, 'ready')
end
return moved

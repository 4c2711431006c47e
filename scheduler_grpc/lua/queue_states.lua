-- KEYS[1]=ready KEYS[2]=processing KEYS[3]=delayed KEYS[4]=dead KEYS[5]=gmem
-- ARGV: ids
-- Returns: one integer per id: 0 = unknown to the queue, 1 = ready, 2 = processing, 3 = delayed,
-- 4 = dead (read in one atomic step, so no id is seen mid-move). An item waiting in its group's
-- backlog (limits, see _groups.lua) is ready.
local ready_key, processing_key, delayed_key, dead_key, gmem_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

local out = {}
for i, id in ipairs(ARGV) do
  if redis.call('ZSCORE', ready_key, id) or redis.call('HEXISTS', gmem_key, id) == 1 then
    out[i] = 1
  elseif redis.call('ZSCORE', processing_key, id) then
    out[i] = 2
  elseif redis.call('ZSCORE', delayed_key, id) then
    out[i] = 3
  elseif redis.call('ZSCORE', dead_key, id) then
    out[i] = 4
  else
    out[i] = 0
  end
end
return out

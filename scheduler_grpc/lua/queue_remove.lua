-- KEYS[1]=ready KEYS[2]=delayed KEYS[3]=priority KEYS[4]=data KEYS[5]=deliveries KEYS[6]=solo
-- KEYS[7]=seq KEYS[8]=marker KEYS[9]=lims KEYS[10]=gwait KEYS[11]=gmem KEYS[12]=gactive
-- KEYS[13]=gdelay KEYS[14]=gblock KEYS[15]=grr KEYS[16]=kpark KEYS[17]=kqueued KEYS[18]=held
-- KEYS[19]=holds
-- ARGV: ids to remove
-- Returns: one integer per id: 1 = it was waiting (ready or delayed) and is now forgotten entirely,
-- 0 = it was not waiting (unknown, processing or dead) and nothing changed.
-- Waiting items hold no lease, owner or dead_reason entry, so those hashes need no cleaning; nor do
-- they hold limit units. An item waiting in its group's backlog (see _groups.lua) is waiting too.
local ready_key, delayed_key, priority_key, data_key, deliveries_key, solo_key, seq_key, marker_key,
  lims_key, gwait_key, gmem_key, gactive_key, gdelay_key, gblock_key, grr_key, kpark_key, kqueued_key,
  held_key, holds_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18], KEYS[19]

-- @include ready_score
-- @include groups

local out = {}
for i, id in ipairs(ARGV) do
  if redis.call('ZREM', ready_key, id) == 1 or redis.call('ZREM', delayed_key, id) == 1
      or (any_limits() and group_remove(id)) then
    redis.call('HDEL', priority_key, id)
    redis.call('HDEL', data_key, id)
    redis.call('HDEL', deliveries_key, id)
    redis.call('SREM', solo_key, id)
    -- (return_units finds nothing in normal operation: a waiting item holds no units)
    if any_limits() and redis.call('HDEL', lims_key, id) == 1 and return_units(id) then
      redis.call('ZADD', marker_key, 0, 'ready')
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out

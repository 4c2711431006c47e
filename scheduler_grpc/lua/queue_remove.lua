-- KEYS[1]=ready KEYS[2]=delayed KEYS[3]=priority KEYS[4]=data KEYS[5]=deliveries KEYS[6]=solo
-- ARGV: ids to remove
-- Returns: one integer per id: 1 = it was waiting (ready or delayed) and is now forgotten entirely,
-- 0 = it was not waiting (unknown, processing or dead) and nothing changed.
-- Waiting items hold no lease, owner or dead_reason entry, so those hashes need no cleaning.
local ready_key, delayed_key, priority_key, data_key, deliveries_key, solo_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]

local out = {}
for i, id in ipairs(ARGV) do
  if redis.call('ZREM', ready_key, id) == 1 or redis.call('ZREM', delayed_key, id) == 1 then
    redis.call('HDEL', priority_key, id)
    redis.call('HDEL', data_key, id)
    redis.call('HDEL', deliveries_key, id)
    redis.call('SREM', solo_key, id)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out

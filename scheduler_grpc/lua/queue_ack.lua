-- KEYS[1]=processing KEYS[2]=priority KEYS[3]=data KEYS[4]=deliveries KEYS[5]=lease KEYS[6]=owner
-- ARGV: two per lease: ARGV[2i+1]=id ARGV[2i+2]=lease token
-- Returns: one integer per lease: 1 = acknowledged and forgotten (no trace left in any hash),
-- 0 = lease lost (the token is not the item's current one; nothing changed).
-- No dead_reason here: only dead items have one, and a leased item is never dead.
local processing_key, priority_key, data_key, deliveries_key, lease_key, owner_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]

local out = {}
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('HGET', lease_key, id) == ARGV[i + 1] then
    redis.call('ZREM', processing_key, id)
    redis.call('HDEL', priority_key, id)
    redis.call('HDEL', data_key, id)
    redis.call('HDEL', deliveries_key, id)
    redis.call('HDEL', lease_key, id)
    redis.call('HDEL', owner_key, id)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out

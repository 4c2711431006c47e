-- KEYS[1]=processing KEYS[2]=priority KEYS[3]=data KEYS[4]=deliveries KEYS[5]=lease KEYS[6]=owner
-- KEYS[7]=ready KEYS[8]=seq KEYS[9]=marker KEYS[10]=lims KEYS[11]=gwait KEYS[12]=gmem KEYS[13]=gactive
-- KEYS[14]=gdelay KEYS[15]=gblock KEYS[16]=grr KEYS[17]=kpark KEYS[18]=kqueued KEYS[19]=held
-- KEYS[20]=holds
-- ARGV: two per lease: ARGV[2i+1]=id ARGV[2i+2]=lease token
-- Returns: one integer per lease: 1 = acknowledged and forgotten (no trace left in any hash),
-- 0 = lease lost (the token is not the item's current one; nothing changed).
-- No dead_reason here: only dead items have one, and a leased item is never dead. An item with
-- limit keys gives its concurrency units back (once: see _groups.lua), waking groups parked on them;
-- the acked items' all at once (one write per key).
local processing_key, priority_key, data_key, deliveries_key, lease_key, owner_key, ready_key, seq_key,
  marker_key, lims_key, gwait_key, gmem_key, gactive_key, gdelay_key, gblock_key, grr_key, kpark_key,
  kqueued_key, held_key, holds_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18], KEYS[19], KEYS[20]

-- @include ready_score
-- @include groups

local out = {}
local acked = {}
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('HGET', lease_key, id) == ARGV[i + 1] then
    redis.call('ZREM', processing_key, id)
    redis.call('HDEL', priority_key, id)
    redis.call('HDEL', data_key, id)
    redis.call('HDEL', deliveries_key, id)
    redis.call('HDEL', lease_key, id)
    redis.call('HDEL', owner_key, id)
    acked[#acked + 1] = id
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
local woke = false
if #acked > 0 and any_limits() then
  redis.call('HDEL', lims_key, unpack(acked))
  woke = return_units_many(acked)
end
if woke then
  redis.call('ZADD', marker_key, 0, 'ready')
end
return out

-- KEYS[1]=processing KEYS[2]=ready KEYS[3]=delayed KEYS[4]=dead KEYS[5]=lease KEYS[6]=owner
-- KEYS[7]=dead_reason KEYS[8]=solo
-- ARGV[1]=id ARGV[2]=lease token of a processing item, or '' for an item waiting in ready/delayed
-- ARGV[3]=reason
-- Returns: 1 if the item was parked in the dead set, 0 if not (lease lost, or no token was given and
-- the item is not waiting); nothing changes on 0.
local processing_key, ready_key, delayed_key, dead_key, lease_key, owner_key, dead_reason_key, solo_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local id = ARGV[1]

if ARGV[2] ~= '' then
  if redis.call('HGET', lease_key, id) ~= ARGV[2] then
    return 0
  end
  redis.call('ZREM', processing_key, id)
  redis.call('HDEL', lease_key, id)
  redis.call('HDEL', owner_key, id)
elseif redis.call('ZREM', ready_key, id) == 0 and redis.call('ZREM', delayed_key, id) == 0 then
  return 0
else
  redis.call('SREM', solo_key, id)  -- a waiting item may be solo; a parked one is not
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', dead_key, string.format('%.0f', now), id)
redis.call('HSET', dead_reason_key, id, ARGV[3])
return 1

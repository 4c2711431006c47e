-- KEYS[1]=processing KEYS[2]=ready KEYS[3]=delayed KEYS[4]=dead KEYS[5]=lease KEYS[6]=owner
-- KEYS[7]=dead_reason KEYS[8]=solo KEYS[9]=seq KEYS[10]=marker KEYS[11]=lims KEYS[12]=gwait
-- KEYS[13]=gmem KEYS[14]=gactive KEYS[15]=gdelay KEYS[16]=gblock KEYS[17]=grr KEYS[18]=kpark
-- KEYS[19]=kqueued KEYS[20]=held KEYS[21]=holds
-- ARGV[1]=id ARGV[2]=lease token of a processing item, or '' for an item waiting in ready/delayed
-- ARGV[3]=reason
-- Returns: 1 if the item was parked in the dead set, 0 if not (lease lost, or no token was given and
-- the item is not waiting); nothing changes on 0.
-- A leased item gives its concurrency units back, once; a waiting one leaves its group's backlog;
-- either keeps its limit keys, so a requeue puts it back in its group (see _groups.lua).
local processing_key, ready_key, delayed_key, dead_key, lease_key, owner_key, dead_reason_key, solo_key,
  seq_key, marker_key, lims_key, gwait_key, gmem_key, gactive_key, gdelay_key, gblock_key, grr_key,
  kpark_key, kqueued_key, held_key, holds_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18], KEYS[19], KEYS[20], KEYS[21]

-- @include ready_score
-- @include groups

local id = ARGV[1]

if ARGV[2] ~= '' then
  if redis.call('HGET', lease_key, id) ~= ARGV[2] then
    return 0
  end
  redis.call('ZREM', processing_key, id)
  redis.call('HDEL', lease_key, id)
  redis.call('HDEL', owner_key, id)
  if has_limits(id) and return_units(id) then
    redis.call('ZADD', marker_key, 0, 'ready')
  end
elseif redis.call('ZREM', ready_key, id) == 0 and redis.call('ZREM', delayed_key, id) == 0
    and not (any_limits() and group_remove(id)) then
  return 0
else
  redis.call('SREM', solo_key, id)  -- a waiting item may be solo; a parked one is not
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', dead_key, string.format('%.0f', now), id)
redis.call('HSET', dead_reason_key, id, ARGV[3])
return 1

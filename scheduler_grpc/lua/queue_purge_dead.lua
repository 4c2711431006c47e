-- KEYS[1]=dead KEYS[2]=priority KEYS[3]=data KEYS[4]=deliveries KEYS[5]=lease KEYS[6]=owner
-- KEYS[7]=dead_reason KEYS[8]=lims
-- ARGV[1]=most items to purge ARGV[2]=only items parked at least this many ms ago (Redis clock), or
-- -1 for any age ARGV[3..]=ids to purge; with none, the earliest parked items
-- Returns: the ids forgotten entirely (dead set and every per-item hash); others are skipped.
local dead_key, priority_key, data_key, deliveries_key, lease_key, owner_key, dead_reason_key, lims_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]

local limit = tonumber(ARGV[1])
local older_than = tonumber(ARGV[2])
local cutoff_ms = math.huge
local cutoff = '+inf'
if older_than >= 0 then
  local t = redis.call('TIME')
  cutoff_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - older_than
  cutoff = string.format('%.0f', cutoff_ms)
end

local candidates = {}
if #ARGV > 2 then
  -- A copy by index: unpack() would overflow the Lua stack on a few thousand ids.
  for i = 3, math.min(#ARGV, limit + 2) do
    candidates[#candidates + 1] = ARGV[i]
  end
else
  candidates = redis.call('ZRANGE', dead_key, '-inf', cutoff, 'BYSCORE', 'LIMIT', 0, limit)
end

local purged = {}
for _, id in ipairs(candidates) do
  local parked = redis.call('ZSCORE', dead_key, id)
  if parked and tonumber(parked) <= cutoff_ms then
    redis.call('ZREM', dead_key, id)
    redis.call('HDEL', priority_key, id)
    redis.call('HDEL', data_key, id)
    redis.call('HDEL', deliveries_key, id)
    redis.call('HDEL', lease_key, id)
    redis.call('HDEL', owner_key, id)
    redis.call('HDEL', dead_reason_key, id)
    redis.call('HDEL', lims_key, id)
    purged[#purged + 1] = id
  end
end
return purged

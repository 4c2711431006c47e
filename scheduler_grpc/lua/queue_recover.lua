-- KEYS[1]=processing KEYS[2]=ready KEYS[3]=dead KEYS[4]=priority KEYS[5]=deliveries KEYS[6]=lease
-- KEYS[7]=owner KEYS[8]=dead_reason KEYS[9]=seq KEYS[10]=marker
-- ARGV[1]=most items to move ARGV[2]=max deliveries ARGV[3]=dead-letter reason (e.g. 'stalled')
-- Returns: {requeued ids, dead-lettered ids}: items whose lease deadline passed (Redis clock), oldest
-- deadline first. Their lease is cleared, so the stale holder's ack/nack/extend fail from now on.
local processing_key, ready_key, dead_key, priority_key, deliveries_key, lease_key, owner_key,
  dead_reason_key, seq_key, marker_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]

-- @include ready_score

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGE', processing_key, '-inf', string.format('%.0f', now), 'BYSCORE',
  'LIMIT', 0, tonumber(ARGV[1]))
local max_deliveries = tonumber(ARGV[2])

local requeued, dead = {}, {}
for _, id in ipairs(expired) do
  redis.call('ZREM', processing_key, id)
  redis.call('HDEL', lease_key, id)
  redis.call('HDEL', owner_key, id)
  -- Every delivery that ended in a stall still counts, so a job that kills each worker taking it
  -- is parked after max_deliveries of them instead of circulating for ever.
  if tonumber(redis.call('HGET', deliveries_key, id) or '0') >= max_deliveries then
    redis.call('ZADD', dead_key, string.format('%.0f', now), id)
    redis.call('HSET', dead_reason_key, id, ARGV[3])
    dead[#dead + 1] = id
  else
    local priority = tonumber(redis.call('HGET', priority_key, id) or '0')
    redis.call('ZADD', ready_key, ready_score(priority), id)
    requeued[#requeued + 1] = id
  end
end
if #requeued > 0 then
  redis.call('ZADD', marker_key, 0, 'ready')
end
return {requeued, dead}

-- KEYS[1]=processing KEYS[2]=ready KEYS[3]=dead KEYS[4]=priority KEYS[5]=deliveries KEYS[6]=lease
-- KEYS[7]=owner KEYS[8]=dead_reason KEYS[9]=seq KEYS[10]=marker KEYS[11]=solo KEYS[12]=delayed
-- KEYS[13]=lims KEYS[14]=gwait KEYS[15]=gmem KEYS[16]=gactive KEYS[17]=gdelay KEYS[18]=gblock
-- KEYS[19]=grr KEYS[20]=kpark KEYS[21]=kqueued KEYS[22]=held KEYS[23]=holds
-- ARGV[1]=most items to move ARGV[2]=max deliveries (max_stalls) ARGV[3]=dead-letter reason (e.g.
-- 'stalled') ARGV[4]=ms a solo delivery that stalled waits before the next one
-- Returns: {requeued ids, dead-lettered ids, the requeued ids' expired lease tokens (aligned with
-- them)}: items whose lease deadline passed (Redis clock), oldest deadline first. The tokens let the
-- scheduler end the attempts those leases held in PostgreSQL (their claim tokens). Their lease is cleared, so the stale holder's ack/nack/extend fail from now on.
-- An item is dead-lettered only when its deliveries passed max and this was a solo delivery (its
-- token ends in 's': it ran alone on its worker, see queue_dequeue), so a worker's death is charged
-- to the item that ran alone on it, not to the items that merely shared it with a poison one. The
-- first solo delivery that stalls is not enough: a kill from outside (a deploy, the OOM killer, an
-- operator) may land on a worker that happens to run one run alone. That item waits ARGV[4] in the
-- delayed set (still solo) and is parked only if its next solo delivery stalls too, so parking takes
-- two deaths of a worker running it alone, apart by that pause, which a burst of outside kills
-- does not make. With max 1 no delivery can be solo beforehand, so the first stall parks an item
-- (the operator's choice). A requeued item whose next delivery will be its max-th joins the solo set.
-- Every expired lease gives its concurrency units back, once (see _groups.lua); a requeued item with
-- limit keys waits in its group rather than in ready.
local processing_key, ready_key, dead_key, priority_key, deliveries_key, lease_key, owner_key,
  dead_reason_key, seq_key, marker_key, solo_key, delayed_key, lims_key, gwait_key, gmem_key, gactive_key,
  gdelay_key, gblock_key, grr_key, kpark_key, kqueued_key, held_key, holds_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18], KEYS[19], KEYS[20], KEYS[21],
  KEYS[22], KEYS[23]

-- @include ready_score
-- @include groups

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGE', processing_key, '-inf', string.format('%.0f', now), 'BYSCORE',
  'LIMIT', 0, tonumber(ARGV[1]))
local max_deliveries = tonumber(ARGV[2])

local requeued, dead, tokens = {}, {}, {}
local woke = false
for _, id in ipairs(expired) do
  local token = redis.call('HGET', lease_key, id) or ''
  redis.call('ZREM', processing_key, id)
  redis.call('HDEL', lease_key, id)
  redis.call('HDEL', owner_key, id)
  -- Every delivery that ended in a stall still counts, so a job that kills each worker taking it
  -- is parked (its last two deliveries alone on a worker, see above) instead of circulating.
  local deliveries = tonumber(redis.call('HGET', deliveries_key, id) or '0')
  local solo = string.sub(token, -1) == 's'
  if has_limits(id) and return_units(id) then
    woke = true
  end
  if max_deliveries <= 1 or (solo and deliveries > max_deliveries) then
    redis.call('ZADD', dead_key, string.format('%.0f', now), id)
    redis.call('HSET', dead_reason_key, id, ARGV[3])
    dead[#dead + 1] = id
  elseif solo then
    -- The first solo stall: once more alone, after a pause (see above).
    redis.call('ZADD', delayed_key, string.format('%.0f', now + tonumber(ARGV[4])), id)
    redis.call('SADD', solo_key, id)
    requeued[#requeued + 1] = id
    tokens[#tokens + 1] = token
  else
    local priority = tonumber(redis.call('HGET', priority_key, id) or '0')
    if make_ready(id, priority) then
      woke = true
    end
    if max_deliveries > 1 and deliveries + 1 >= max_deliveries then
      redis.call('SADD', solo_key, id)
    end
    requeued[#requeued + 1] = id
    tokens[#tokens + 1] = token
  end
end
if woke then
  redis.call('ZADD', marker_key, 0, 'ready')
end
return {requeued, dead, tokens}

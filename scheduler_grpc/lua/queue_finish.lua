-- KEYS[1]=processing KEYS[2]=ready KEYS[3]=delayed KEYS[4]=dead KEYS[5]=priority KEYS[6]=data
-- KEYS[7]=deliveries KEYS[8]=lease KEYS[9]=owner KEYS[10]=dead_reason KEYS[11]=seq KEYS[12]=marker
-- KEYS[13]=solo KEYS[14]=lims KEYS[15]=gwait KEYS[16]=gmem KEYS[17]=gactive KEYS[18]=gdelay
-- KEYS[19]=gblock KEYS[20]=grr KEYS[21]=kpark KEYS[22]=kqueued KEYS[23]=held KEYS[24]=holds
-- ARGV: four per lease: ARGV[4i+1]=what ('a' ack, 'r' retry, 'd' dead-letter) ARGV[4i+2]=id
-- ARGV[4i+3]=lease token ARGV[4i+4]=for 'r' the delay in ms (0: ready now), for 'd' the reason
-- Returns: one integer per lease: 1 = done, 0 = lease lost (the token is not the item's current
-- one; nothing changed for that item).
-- A worker's whole completion batch in one call: 'a' is queue_ack, 'r' is queue_nack with the
-- delivery given back (only stalls count towards the stall limit), 'd' is queue_dead_letter of a
-- processing item. Safe to resend: a repeat finds the tokens gone and answers 0.
-- An 'r' of a solo delivery (token ending in 's', see queue_dequeue) keeps the next delivery solo.
-- An 'r' item that becomes the earliest delayed item sets the marker (as an enqueue does), so an idle
-- worker sleeping until a later item learns the new time (a reserved run handed back, due soon).
-- Every lease ended here gives its concurrency units back, once (see _groups.lua; the acks' all
-- at once, one write per key); an 'r' item with
-- limit keys waits in its group rather than in ready; a dead item keeps its limit keys (a requeue
-- puts it back in its group).
local processing_key, ready_key, delayed_key, dead_key, priority_key, data_key, deliveries_key, lease_key,
  owner_key, dead_reason_key, seq_key, marker_key, solo_key, lims_key, gwait_key, gmem_key, gactive_key,
  gdelay_key, gblock_key, grr_key, kpark_key, kqueued_key, held_key, holds_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12],
  KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18], KEYS[19], KEYS[20], KEYS[21], KEYS[22], KEYS[23],
  KEYS[24]

-- @include ready_score
-- @include groups

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local out = {}
local made_ready = false
local earliest_added
-- Acked runs whose limit keys are not yet forgotten nor their units given back: done together
-- (return_units_many) before the next 'r' or 'd' and at the end, so a run made ready after them
-- finds the same groups awake as returns one by one would leave.
local acked = {}
local function return_acked()
  if #acked > 0 then
    redis.call('HDEL', lims_key, unpack(acked))
    if return_units_many(acked) then
      made_ready = true
    end
    acked = {}
  end
end
for i = 1, #ARGV, 4 do
  local what, id = ARGV[i], ARGV[i + 1]
  if redis.call('HGET', lease_key, id) == ARGV[i + 2] then
    redis.call('ZREM', processing_key, id)
    redis.call('HDEL', lease_key, id)
    redis.call('HDEL', owner_key, id)
    if what == 'a' then
      redis.call('HDEL', priority_key, id)
      redis.call('HDEL', data_key, id)
      redis.call('HDEL', deliveries_key, id)
      if any_limits() then
        acked[#acked + 1] = id
      end
    else
      return_acked()
      if has_limits(id) and return_units(id) then
        made_ready = true
      end
    end
    if what == 'r' then
      if redis.call('HINCRBY', deliveries_key, id, -1) <= 0 then
        redis.call('HDEL', deliveries_key, id)
      end
      if string.sub(ARGV[i + 2], -1) == 's' then
        redis.call('SADD', solo_key, id)
      end
      local delay = tonumber(ARGV[i + 3])
      if delay > 0 then
        redis.call('ZADD', delayed_key, string.format('%.0f', now + delay), id)
        if not earliest_added or now + delay < earliest_added then
          earliest_added = now + delay
        end
      else
        local priority = tonumber(redis.call('HGET', priority_key, id) or '0')
        if make_ready(id, priority) then
          made_ready = true
        end
      end
    elseif what == 'd' then
      redis.call('ZADD', dead_key, string.format('%.0f', now), id)
      redis.call('HSET', dead_reason_key, id, ARGV[i + 3])
    end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return_acked()
if not made_ready and earliest_added then
  -- ZRANGE after the adds: the earliest is one of ours exactly when nothing else was due sooner.
  local earliest = redis.call('ZRANGE', delayed_key, 0, 0, 'WITHSCORES')
  made_ready = tonumber(earliest[2]) >= earliest_added
end
if made_ready then
  redis.call('ZADD', marker_key, 0, 'ready')
end
return out

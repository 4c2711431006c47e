-- KEYS[1]=processing KEYS[2]=ready KEYS[3]=delayed KEYS[4]=priority KEYS[5]=deliveries KEYS[6]=lease
-- KEYS[7]=owner KEYS[8]=seq KEYS[9]=marker KEYS[10]=solo KEYS[11]=lims KEYS[12]=gwait KEYS[13]=gmem
-- KEYS[14]=gactive KEYS[15]=gdelay KEYS[16]=gblock KEYS[17]=grr KEYS[18]=kpark KEYS[19]=kqueued
-- KEYS[20]=held KEYS[21]=holds KEYS[22]=kpause
-- ARGV[1]=delay in ms (0: back to ready now, else to delayed) ARGV[2]=1 to keep counting this
-- delivery, 0 to give it back (work returned unstarted) ARGV[3]=max_stalls
-- ARGV[4]=retry-after in ms (0: none): back-pressure from the upstream; each item's limit keys are
-- paused that long (a pause never shortens), the delivery is given back, and the item rejoins its
-- group now (an item without limits goes to delayed for that long instead of ARGV[1])
-- ARGV[5..]: two per lease: id, lease token
-- Returns: one integer per lease: 1 = returned to the queue with its priority, 0 = lease lost
-- (nothing changed).
-- The item's next delivery is solo (see queue_dequeue) when this one was (its token ends in 's'),
-- or when it is kept counted and the next would be the max_stalls-th. An item with limit keys gives
-- its concurrency units back (see _groups.lua) and waits in its group rather than in ready.
local processing_key, ready_key, delayed_key, priority_key, deliveries_key, lease_key, owner_key,
  seq_key, marker_key, solo_key, lims_key, gwait_key, gmem_key, gactive_key, gdelay_key, gblock_key,
  grr_key, kpark_key, kqueued_key, held_key, holds_key, kpause_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18], KEYS[19], KEYS[20], KEYS[21],
  KEYS[22]

-- @include ready_score
-- @include groups

local delay = tonumber(ARGV[1])
local max_stalls = tonumber(ARGV[3])
local pause = tonumber(ARGV[4])
local count_delivery = ARGV[2] == '1' and pause == 0
local now
if delay > 0 or pause > 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local out = {}
local made_ready = false
for i = 5, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('HGET', lease_key, id) == ARGV[i + 1] then
    redis.call('ZREM', processing_key, id)
    redis.call('HDEL', lease_key, id)
    redis.call('HDEL', owner_key, id)
    local solo = string.sub(ARGV[i + 1], -1) == 's'
    if not count_delivery then
      if redis.call('HINCRBY', deliveries_key, id, -1) <= 0 then
        redis.call('HDEL', deliveries_key, id)
      end
    elseif max_stalls > 1 and tonumber(redis.call('HGET', deliveries_key, id) or '0') + 1 >= max_stalls then
      solo = true
    end
    if solo then
      redis.call('SADD', solo_key, id)
    end
    local group = any_limits() and redis.call('HGET', lims_key, id)
    local wait = delay
    if group then
      if pause > 0 then
        local until_ms = string.format('%.0f', now + pause)
        for _, e in ipairs(group_entries(group)) do
          redis.call('ZADD', kpause_key, 'GT', until_ms, lk_of(e[1], e[2]))
        end
        wait = 0
      end
      if return_units(id) then
        made_ready = true
      end
    elseif pause > 0 then
      wait = pause
    end
    if wait > 0 then
      redis.call('ZADD', delayed_key, string.format('%.0f', now + wait), id)
    else
      -- A fresh sequence number: the item rejoins the back of its priority, like any new arrival.
      local priority = tonumber(redis.call('HGET', priority_key, id) or '0')
      if make_ready(id, priority) then
        made_ready = true
      end
    end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if made_ready then
  redis.call('ZADD', marker_key, 0, 'ready')
end
return out

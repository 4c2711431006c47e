-- KEYS[1]=processing KEYS[2]=ready KEYS[3]=delayed KEYS[4]=priority KEYS[5]=deliveries KEYS[6]=lease
-- KEYS[7]=owner KEYS[8]=seq KEYS[9]=marker KEYS[10]=solo
-- ARGV[1]=delay in ms (0: back to ready now, else to delayed) ARGV[2]=1 to keep counting this
-- delivery, 0 to give it back (work returned unstarted) ARGV[3]=max_stalls
-- ARGV[4..]: two per lease: id, lease token
-- Returns: one integer per lease: 1 = returned to the queue with its priority, 0 = lease lost
-- (nothing changed).
-- The item's next delivery is solo (see queue_dequeue) when this one was (its token ends in 's'),
-- or when it is kept counted and the next would be the max_stalls-th.
local processing_key, ready_key, delayed_key, priority_key, deliveries_key, lease_key, owner_key,
  seq_key, marker_key, solo_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]

-- @include ready_score

local delay = tonumber(ARGV[1])
local max_stalls = tonumber(ARGV[3])
local due
if delay > 0 then
  local t = redis.call('TIME')
  due = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + delay)
end

local out = {}
local made_ready = false
for i = 4, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('HGET', lease_key, id) == ARGV[i + 1] then
    redis.call('ZREM', processing_key, id)
    redis.call('HDEL', lease_key, id)
    redis.call('HDEL', owner_key, id)
    local solo = string.sub(ARGV[i + 1], -1) == 's'
    if ARGV[2] == '0' then
      if redis.call('HINCRBY', deliveries_key, id, -1) <= 0 then
        redis.call('HDEL', deliveries_key, id)
      end
    elseif max_stalls > 1 and tonumber(redis.call('HGET', deliveries_key, id) or '0') + 1 >= max_stalls then
      solo = true
    end
    if solo then
      redis.call('SADD', solo_key, id)
    end
    if due then
      redis.call('ZADD', delayed_key, due, id)
    else
      -- A fresh sequence number: the item rejoins the back of its priority, like any new arrival.
      local priority = tonumber(redis.call('HGET', priority_key, id) or '0')
      redis.call('ZADD', ready_key, ready_score(priority), id)
      made_ready = true
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

-- KEYS[1]=ready KEYS[2]=marker KEYS[3]=gactive
-- ARGV: none
-- Returns: 1 if work is ready (or a group of runs with limits is active) and the wake-up marker is
-- now set, else 0. Used after a waiter was
-- cancelled mid-BZPOPMIN: it may have consumed the marker, and another idle worker must still wake.
local ready_key, marker_key, gactive_key =
  KEYS[1], KEYS[2], KEYS[3]

if redis.call('ZCARD', ready_key) > 0 or redis.call('ZCARD', gactive_key) > 0 then
  redis.call('ZADD', marker_key, 0, 'ready')
  return 1
end
return 0

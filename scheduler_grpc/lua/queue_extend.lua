-- KEYS[1]=processing KEYS[2]=lease
-- ARGV[1]=id ARGV[2]=lease token ARGV[3]=lease length in ms, counted from now (Redis clock)
-- Returns: the new lease deadline in ms, or -1 when the lease was lost (nothing changed).
local processing_key, lease_key = KEYS[1], KEYS[2]

if redis.call('HGET', lease_key, ARGV[1]) ~= ARGV[2] then
  return -1
end
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[3])
redis.call('ZADD', processing_key, string.format('%.0f', deadline), ARGV[1])
return deadline

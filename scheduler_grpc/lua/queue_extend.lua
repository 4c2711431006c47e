-- KEYS[1]=processing KEYS[2]=lease
-- ARGV[1]=lease length in ms, counted from now (Redis clock) ARGV[2..]: two per lease: id, lease token
-- Returns: one integer per lease: its new deadline in ms, or -1 when the lease was lost (that lease
-- is left unchanged). A worker keeps all its running leases with one call.
local processing_key, lease_key = KEYS[1], KEYS[2]

local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local deadline_score = string.format('%.0f', deadline)
local results = {}
for i = 2, #ARGV, 2 do
  if redis.call('HGET', lease_key, ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', processing_key, deadline_score, ARGV[i])
    results[#results + 1] = deadline
  else
    results[#results + 1] = -1
  end
end
return results

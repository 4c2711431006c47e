-- KEYS[1]=delayed KEYS[2]=ready KEYS[3]=priority KEYS[4]=seq KEYS[5]=marker
-- ARGV[1]=most items to move
-- Returns: the ids moved from delayed to ready because their due time passed (Redis clock), in due
-- order; each keeps its priority and joins the back of it.
local delayed_key, ready_key, priority_key, seq_key, marker_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

-- @include ready_score
-- @include promote_due

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = promote_due(now, tonumber(ARGV[1]))
if #due > 0 then
  redis.call('ZADD', marker_key, 0, 'ready')
end
return due

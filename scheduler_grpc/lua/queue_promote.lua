-- KEYS[1]=delayed KEYS[2]=ready KEYS[3]=priority KEYS[4]=seq KEYS[5]=marker KEYS[6]=lims
-- KEYS[7]=gwait KEYS[8]=gmem KEYS[9]=gactive KEYS[10]=gdelay KEYS[11]=gblock KEYS[12]=grr
-- KEYS[13]=kpark KEYS[14]=kqueued KEYS[15]=held KEYS[16]=holds
-- ARGV[1]=most items to move
-- Returns: the ids moved from delayed to ready because their due time passed (Redis clock), in due
-- order; each keeps its priority and joins the back of it (an item with limit keys: of its group's
-- backlog). Parked groups whose time has come (rate retry, pause end) are woken too (not listed).
local delayed_key, ready_key, priority_key, seq_key, marker_key, lims_key, gwait_key, gmem_key, gactive_key,
  gdelay_key, gblock_key, grr_key, kpark_key, kqueued_key, held_key, holds_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16]

-- @include ready_score
-- @include groups
-- @include promote_due

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due, wake = promote_due(now, tonumber(ARGV[1]))
if promote_groups(now, tonumber(ARGV[1])) > 0 then
  wake = true
end
if wake then
  redis.call('ZADD', marker_key, 0, 'ready')
end
return due

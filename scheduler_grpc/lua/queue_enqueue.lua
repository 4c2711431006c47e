-- KEYS[1]=ready KEYS[2]=delayed KEYS[3]=priority KEYS[4]=data KEYS[5]=seq KEYS[6]=marker
-- KEYS[7]=limdef KEYS[8]=lims KEYS[9]=gwait KEYS[10]=gmem KEYS[11]=gactive KEYS[12]=gdelay
-- KEYS[13]=gblock KEYS[14]=grr KEYS[15]=kpark KEYS[16]=kqueued KEYS[17]=held KEYS[18]=holds
-- ARGV[1]=number of limit definitions D, then ARGV[2..2D+1]: two per definition: name, encoded
-- (written to limdef first where it has none: a definition travels with the work that needs it,
-- and never replaces one a put wrote, which may be newer than the enqueuer's copy)
-- then five per item: id, priority (-1000..1000, checked by the caller), delay in ms (0: ready now),
-- data (opaque bytes; '' stores nothing), group (its limit keys, see _groups.lua; '' for none)
-- Returns: the number of items added. An id the queue already knows, in any state, is skipped,
-- which makes enqueueing idempotent per id.
-- A delayed item is due `delay` after now, now rounded UP to the millisecond (dequeue and promote
-- compare with now rounded down), so it never becomes ready before `delay` has passed. When one
-- becomes the earliest delayed item, the marker wakes an idle worker, whose dequeue then tells it
-- when that item is due (it may be sleeping until a later one). An item with limit keys that is
-- ready now waits in its group's backlog instead of ready (see _groups.lua).
local ready_key, delayed_key, priority_key, data_key, seq_key, marker_key, limdef_key, lims_key, gwait_key,
  gmem_key, gactive_key, gdelay_key, gblock_key, grr_key, kpark_key, kqueued_key, held_key, holds_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18]

-- @include ready_score
-- @include groups

local defs = tonumber(ARGV[1])
for i = 2, 2 * defs, 2 do
  redis.call('HSETNX', limdef_key, ARGV[i], ARGV[i + 1])
end

local now
local added = 0
local wake = false
local earliest_added
for i = 2 * defs + 2, #ARGV, 5 do
  local id = ARGV[i]
  -- The priority hash doubles as the set of known ids: HSETNX is the idempotency check.
  if redis.call('HSETNX', priority_key, id, ARGV[i + 1]) == 1 then
    if ARGV[i + 3] ~= '' then
      redis.call('HSET', data_key, id, ARGV[i + 3])
    end
    local group = ARGV[i + 4]
    if group ~= '' then
      redis.call('HSET', lims_key, id, group)
    end
    local delay = tonumber(ARGV[i + 2])
    if delay > 0 then
      if not now then
        local t = redis.call('TIME')
        now = tonumber(t[1]) * 1000 + math.ceil(tonumber(t[2]) / 1000)
      end
      local due = now + delay
      if not earliest_added or due < earliest_added then
        earliest_added = due
      end
      redis.call('ZADD', delayed_key, string.format('%.0f', due), id)
    elseif group ~= '' then
      if group_add(id, group, ready_score(tonumber(ARGV[i + 1]))) then
        wake = true
      end
    else
      redis.call('ZADD', ready_key, ready_score(tonumber(ARGV[i + 1])), id)
      wake = true
    end
    added = added + 1
  end
end
if not wake and earliest_added then
  -- ZRANGE after the adds: the earliest is one of ours exactly when nothing else was due sooner.
  local earliest = redis.call('ZRANGE', delayed_key, 0, 0, 'WITHSCORES')
  wake = tonumber(earliest[2]) >= earliest_added
end
if wake then
  redis.call('ZADD', marker_key, 0, 'ready')
end
return added

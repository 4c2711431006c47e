-- KEYS[1]=ready KEYS[2]=delayed KEYS[3]=priority KEYS[4]=data KEYS[5]=seq KEYS[6]=marker
-- ARGV: four per item: ARGV[4i+1]=id ARGV[4i+2]=priority (-1000..1000, checked by the caller)
--       ARGV[4i+3]=delay in ms (0: ready now) ARGV[4i+4]=data (opaque bytes; '' stores nothing)
-- Returns: the number of items added. An id the queue already knows, in any state, is skipped,
-- which makes enqueueing idempotent per id.
-- A delayed item is due `delay` after now, now rounded UP to the millisecond (dequeue and promote
-- compare with now rounded down), so it never becomes ready before `delay` has passed. When one
-- becomes the earliest delayed item, the marker wakes an idle worker, whose dequeue then tells it
-- when that item is due (it may be sleeping until a later one).
local ready_key, delayed_key, priority_key, data_key, seq_key, marker_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]

-- @include ready_score

local now
local added = 0
local wake = false
local earliest_added
for i = 1, #ARGV, 4 do
  local id = ARGV[i]
  -- The priority hash doubles as the set of known ids: HSETNX is the idempotency check.
  if redis.call('HSETNX', priority_key, id, ARGV[i + 1]) == 1 then
    if ARGV[i + 3] ~= '' then
      redis.call('HSET', data_key, id, ARGV[i + 3])
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

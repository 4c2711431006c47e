-- KEYS[1]=ready KEYS[2]=processing KEYS[3]=priority KEYS[4]=data KEYS[5]=deliveries KEYS[6]=lease
-- KEYS[7]=owner KEYS[8]=lease_seq KEYS[9]=marker KEYS[10]=delayed KEYS[11]=seq KEYS[12]=solo
-- KEYS[13]=drainer
-- ARGV[1]=worker id ARGV[2]=visibility timeout in ms ARGV[3]=most items to take
-- ARGV[4]=most due delayed items to promote first
-- ARGV[5]=reserve window in ms (0: reserve nothing) ARGV[6]=most delayed items to reserve
-- ARGV[7]=1 when the caller is idle (it holds no run at all), else 0
-- Returns: {} when nothing was leased, nothing is delayed and no solo item waits for the caller;
-- {wait_ms, drain} when nothing was leased: wait_ms is how long until the earliest delayed item the
-- caller may take is due (Redis clock, as a duration; with reservations on, until it comes within
-- the window), -1 when there is none; drain is 1 when the caller skipped a solo item and is now its
-- drainer (see below), else 0. Otherwise {deadline_ms, flags, id, token, data, priority,
-- deliveries, due_in_ms, id, ...}: the best ready items, best first, then the reserved items in due
-- order, each now leased to the worker until deadline_ms (Redis clock); flags is 1 (drain, as
-- above) + 2 (the reply's one lease is a solo delivery). due_in_ms is -1 for a ready item; for a
-- reserved one, how long until it is due (Redis clock, as a duration: no host clock matters).
-- Delayed items whose due time has passed are promoted to ready first (up to ARGV[4]), so a worker
-- takes work at its due time without waiting for the leader's promote loop.
-- Reservations: when the ready items do not fill ARGV[3], delayed items due within the window (up
-- to ARGV[6]) are leased too, taken out of the delayed set: the worker claims them ahead and
-- starts each at its due time.
-- Solo items (the solo set: items that stalled max_stalls - 1 times, see queue_recover) are leased
-- only to an idle caller, one alone (a solo delivery, its token ending in 's'), so a worker that dies
-- during it died of that item. Other callers skip them, keeping their place; one of those, the
-- drainer (SET NX for a visibility timeout), is told to become idle. Nobody reserves one. With the
-- solo set empty the only extra cost is one SCARD.
-- Safe to resend only under the resend guard (queue.py wraps it): it leases what it pops.
local ready_key, processing_key, priority_key, data_key, deliveries_key, lease_key, owner_key,
  lease_seq_key, marker_key, delayed_key, seq_key, solo_key, drainer_key = KEYS[1], KEYS[2], KEYS[3],
  KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]

-- @include ready_score
-- @include promote_due

local worker = ARGV[1]
local count = tonumber(ARGV[3])
local window = tonumber(ARGV[5])
local reserve_most = tonumber(ARGV[6])
local idle = ARGV[7] == '1'
local reserving = window > 0 and reserve_most > 0
-- Most solo items one call reads past: a non-idle dequeue reads at most this many extra entries.
local MAX_SKIP = 1000
local solo_count = redis.call('SCARD', solo_key)
local skip_span = math.min(solo_count, MAX_SKIP)

local function is_solo(id)
  return solo_count > 0 and redis.call('SISMEMBER', solo_key, id) == 1
end

-- The earliest delayed item: when it is due, the due items are promoted first, so they compete
-- with ready ones by priority; when it is not, an idle caller learns when to come back.
local earliest = redis.call('ZRANGE', delayed_key, 0, 0, 'WITHSCORES')
local t, now
local function read_clock()
  t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
if #earliest > 0 then
  read_clock()
  if tonumber(earliest[2]) <= now then
    promote_due(now, tonumber(ARGV[4]))
  end
end

if idle and redis.call('GET', drainer_key) == worker then
  -- The drainer is idle now: its turn is over, whatever it finds.
  redis.call('DEL', drainer_key)
end

-- The best solo item in ready, taken out of ready and the solo set; nil when none is ready. A member
-- no longer waiting anywhere (forgotten by some path) is dropped from the set on the way.
local function take_best_solo()
  local best, best_score
  for _, id in ipairs(redis.call('SMEMBERS', solo_key)) do
    local score = redis.call('ZSCORE', ready_key, id)
    if score then
      score = tonumber(score)
      if not best or score < best_score then
        best, best_score = id, score
      end
    elseif not redis.call('ZSCORE', delayed_key, id) then
      redis.call('SREM', solo_key, id)
    end
  end
  if best then
    redis.call('ZREM', ready_key, best)
    redis.call('SREM', solo_key, best)
  end
  return best
end

local popped = {}
local solo_id
local skipped = false
if solo_count == 0 then
  popped = redis.call('ZPOPMIN', ready_key, count)
else
  if idle then
    solo_id = take_best_solo()
  end
  if not solo_id then
    -- At most skip_span of these are solo, so the rest fill the request when ready holds enough.
    local head = redis.call('ZRANGE', ready_key, 0, count + skip_span - 1, 'WITHSCORES')
    for i = 1, #head, 2 do
      if is_solo(head[i]) then
        skipped = true
      elseif #popped < 2 * count then
        redis.call('ZREM', ready_key, head[i])
        popped[#popped + 1] = head[i]
        popped[#popped + 1] = head[i + 1]
      end
    end
  end
end

-- Ready items first: reserve only when they leave the request unfilled (a draining worker pays
-- nothing), and only when the earliest delayed item is within the window (else no range read).
local reserved = {}
if not solo_id and reserving and #popped < 2 * count and #earliest > 0
    and tonumber(earliest[2]) <= now + window then
  local found = redis.call('ZRANGE', delayed_key, '-inf', string.format('%.0f', now + window), 'BYSCORE',
    'LIMIT', 0, reserve_most + skip_span, 'WITHSCORES')
  if solo_count == 0 then
    reserved = found
  else
    for i = 1, #found, 2 do
      if #reserved < 2 * reserve_most and not is_solo(found[i]) then
        reserved[#reserved + 1] = found[i]
        reserved[#reserved + 1] = found[i + 1]
      end
    end
  end
end

-- Whether a skipping caller becomes the drainer (or already is): the one worker told to go idle.
local function drain()
  if not skipped then
    return false
  end
  if redis.call('SET', drainer_key, worker, 'NX', 'PX', ARGV[2]) then
    return true
  end
  return redis.call('GET', drainer_key) == worker
end

-- Whether ready holds an item a busy worker may take (solo items wake nobody: an idle worker finds
-- them within its blocking wait's bound).
local function work_left()
  if solo_count == 0 then
    return redis.call('ZCARD', ready_key) > 0
  end
  for _, id in ipairs(redis.call('ZRANGE', ready_key, 0, skip_span)) do
    if not is_solo(id) then
      return true
    end
  end
  return false
end

if #popped == 0 and #reserved == 0 and not solo_id then
  -- Nothing ready for this caller, so no idle worker should wake for it; the next enqueue sets the
  -- marker again.
  redis.call('DEL', marker_key)
  local head = earliest
  if solo_count > 0 and #earliest > 0 then
    -- Re-read: items may have been promoted (solo ones stay ready), and solo ones are not for every caller.
    head = redis.call('ZRANGE', delayed_key, 0, skip_span, 'WITHSCORES')
  end
  -- The caller sleeps until the earliest item it may take is due, or comes within the window
  -- (BullMQ's delayed marker; a solo item is never reserved, and only an idle caller takes one),
  -- measured on this clock and handed over as a duration, so the worker's own clock never matters.
  local ahead
  for i = 1, #head, 2 do
    local due = tonumber(head[i + 1]) - now
    local solo = is_solo(head[i])
    if not solo and reserving then
      due = due - window
    end
    if (idle or not solo) and (not ahead or due < ahead) then
      ahead = due
    end
  end
  local draining = drain()
  if not ahead and not draining then
    return {}
  end
  return {ahead and math.max(1, ahead) or -1, draining and 1 or 0}
end

if not t then
  read_clock()
end
local deadline = string.format('%.0f', now + tonumber(ARGV[2]))
-- A token joins the lease counter with the server time, so it stays unique per delivery even if
-- Redis restarts without its data and the counter starts over.
local stamp = '.' .. t[1] .. string.format('%06d', tonumber(t[2]))

local out = {deadline, (drain() and 1 or 0) + (solo_id and 2 or 0)}
local function lease(id, due_in, suffix)
  local token = string.format('%d', redis.call('INCR', lease_seq_key)) .. stamp .. suffix
  redis.call('ZADD', processing_key, deadline, id)
  redis.call('HSET', lease_key, id, token)
  redis.call('HSET', owner_key, id, worker)
  local deliveries = redis.call('HINCRBY', deliveries_key, id, 1)
  out[#out + 1] = id
  out[#out + 1] = token
  -- A nil inside a Lua array would truncate the reply, hence the defaults.
  out[#out + 1] = redis.call('HGET', data_key, id) or ''
  out[#out + 1] = redis.call('HGET', priority_key, id) or '0'
  out[#out + 1] = deliveries
  out[#out + 1] = due_in
end
if solo_id then
  lease(solo_id, -1, 's')
end
for i = 1, #popped, 2 do
  lease(popped[i], -1, '')
end
for i = 1, #reserved, 2 do
  redis.call('ZREM', delayed_key, reserved[i])
  lease(reserved[i], math.max(0, tonumber(reserved[i + 1]) - now), '')
end

-- BullMQ's marker pattern: work is left, so wake another idle worker; otherwise nobody should wake.
if work_left() then
  redis.call('ZADD', marker_key, 0, 'ready')
else
  redis.call('DEL', marker_key)
end
return out

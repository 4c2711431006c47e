-- KEYS[1]=ready KEYS[2]=processing KEYS[3]=priority KEYS[4]=data KEYS[5]=deliveries KEYS[6]=lease
-- KEYS[7]=owner KEYS[8]=lease_seq KEYS[9]=marker KEYS[10]=delayed KEYS[11]=seq
-- ARGV[1]=worker id ARGV[2]=visibility timeout in ms ARGV[3]=most items to take
-- ARGV[4]=most due delayed items to promote first
-- ARGV[5]=reserve window in ms (0: reserve nothing) ARGV[6]=most delayed items to reserve
-- Returns: {} when nothing is ready, reserved nor delayed; {wait_ms} when nothing is ready nor
-- reserved and the earliest delayed item is due in wait_ms (Redis clock; with reservations on,
-- when it comes within the window); else {deadline_ms, id, token, data, priority, deliveries,
-- due_in_ms, id, ...}: the best ready items, best first, then the reserved items in due order,
-- each now leased to the worker until deadline_ms (Redis clock). due_in_ms is -1 for a ready item;
-- for a reserved one, how long until it is due (Redis clock, as a duration: no host clock matters).
-- Delayed items whose due time has passed are promoted to ready first (up to ARGV[4]), so a worker
-- takes work at its due time without waiting for the leader's promote loop.
-- Reservations: when the ready items do not fill ARGV[3], delayed items due within the window (up
-- to ARGV[6]) are leased too, taken out of the delayed set: the worker claims them ahead and
-- starts each at its due time.
local ready_key, processing_key, priority_key, data_key, deliveries_key, lease_key, owner_key,
  lease_seq_key, marker_key, delayed_key, seq_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]

-- @include ready_score
-- @include promote_due

local count = tonumber(ARGV[3])
local window = tonumber(ARGV[5])
local reserve_most = tonumber(ARGV[6])
local reserving = window > 0 and reserve_most > 0

-- The earliest delayed item: when it is due, the due items are promoted first, so they compete
-- with ready ones by priority; when it is not, an idle caller learns when to come back.
local earliest = redis.call('ZRANGE', delayed_key, 0, 0, 'WITHSCORES')
local t, now
if #earliest > 0 then
  t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if tonumber(earliest[2]) <= now then
    promote_due(now, tonumber(ARGV[4]))
  end
end

local popped = redis.call('ZPOPMIN', ready_key, count)

-- Ready items first: reserve only when they leave the request unfilled (a draining worker pays
-- nothing), and only when the earliest delayed item is within the window (else no range read).
local reserved = {}
if reserving and #popped < 2 * count and #earliest > 0 and tonumber(earliest[2]) <= now + window then
  reserved = redis.call('ZRANGE', delayed_key, '-inf', string.format('%.0f', now + window), 'BYSCORE',
    'LIMIT', 0, reserve_most, 'WITHSCORES')
end

if #popped == 0 then
  -- Ready is empty, so no idle worker should wake for it; the next enqueue sets the marker again.
  redis.call('DEL', marker_key)
  if #reserved == 0 then
    if #earliest == 0 then
      return {}
    end
    -- Nothing was promoted (ready would not be empty), so the earliest delayed item is still ahead
    -- (and beyond the window when reserving). The caller sleeps until it is due, or until it comes
    -- within the window (BullMQ's delayed marker), measured on this clock and handed over as a
    -- duration, so the worker's own clock never matters.
    local ahead = tonumber(earliest[2]) - now
    if reserving then
      ahead = ahead - window
    end
    return {math.max(1, ahead)}
  end
end

if not t then
  t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local deadline = string.format('%.0f', now + tonumber(ARGV[2]))
-- A token joins the lease counter with the server time, so it stays unique per delivery even if
-- Redis restarts without its data and the counter starts over.
local stamp = '.' .. t[1] .. string.format('%06d', tonumber(t[2]))

local out = {deadline}
local function lease(id, due_in)
  local token = string.format('%d', redis.call('INCR', lease_seq_key)) .. stamp
  redis.call('ZADD', processing_key, deadline, id)
  redis.call('HSET', lease_key, id, token)
  redis.call('HSET', owner_key, id, ARGV[1])
  local deliveries = redis.call('HINCRBY', deliveries_key, id, 1)
  out[#out + 1] = id
  out[#out + 1] = token
  -- A nil inside a Lua array would truncate the reply, hence the defaults.
  out[#out + 1] = redis.call('HGET', data_key, id) or ''
  out[#out + 1] = redis.call('HGET', priority_key, id) or '0'
  out[#out + 1] = deliveries
  out[#out + 1] = due_in
end
for i = 1, #popped, 2 do
  lease(popped[i], -1)
end
for i = 1, #reserved, 2 do
  redis.call('ZREM', delayed_key, reserved[i])
  lease(reserved[i], math.max(0, tonumber(reserved[i + 1]) - now))
end

-- BullMQ's marker pattern: work is left, so wake another idle worker; otherwise nobody should wake.
if redis.call('ZCARD', ready_key) > 0 then
  redis.call('ZADD', marker_key, 0, 'ready')
else
  redis.call('DEL', marker_key)
end
return out

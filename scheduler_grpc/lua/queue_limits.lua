-- KEYS[1]=ready KEYS[2]=seq KEYS[3]=marker KEYS[4]=limdef KEYS[5]=lims KEYS[6]=gwait KEYS[7]=gmem
-- KEYS[8]=gactive KEYS[9]=gdelay KEYS[10]=gblock KEYS[11]=grr KEYS[12]=kpark KEYS[13]=kqueued
-- KEYS[14]=held KEYS[15]=holds KEYS[16]=tat KEYS[17]=tatrem KEYS[18]=kpause KEYS[19]=recount
-- ARGV[1]=operation, then its arguments:
--   'define' name, encoded, name, encoded...: store definitions (gcra.py `encode_definition`), and
--     wake up to 1000 groups per limit parked on its keys, so a raised limit admits at once
--   'undefine' name...: forget definitions (runs that need one then wait, parked on their key)
--   'pause' limit, key, ms (-1: until resumed): the key admits nothing until then (Redis clock)
--   'resume' limit, key: end a pause now and wake up to 1000 groups parked on the key
--   'state' limit, key: read the key's state
--   'blocked' id...: why each waiting run waits
--   'hold' id, group, id, group...: after Redis lost them, count again the concurrency units of runs
--     still running (PostgreSQL says so) that this queue knows in no state: each such run holds its
--     units as its lease did (held, its holds record) and is listed in recount; a run with a holds
--     record or known with limits (lims) is left alone, so a hold is idempotent per run id
--   'unhold' id...: give back the units `hold` counted for runs no longer running (once per run)
--   'recounted': the ids `hold` counted and `unhold` has not given back (at most 10,000)
--   'pause_equal' ms, key, id...: pause for ms every limit key of these items whose key text equals
--     `key` (case-insensitive; an open breaker on a webhook host pauses the limits keyed on the host);
--     a later pause already set is kept
-- Returns: 'define', 'resume': groups woken; 'undefine': definitions removed; 'pause': the end in
-- ms; 'state': {running units, queued runs, next admission ms (-1: unknown, a concurrency limit is
-- full or the limit has no definition), paused until ms (-1: not paused), now ms}; 'blocked': five
-- per run whose group is parked: id, limit, key, since ms, kind ('c' concurrency, 'r' rate, 'p'
-- paused, 'u' no definition or a limit of 0); runs not parked are left out. 'hold': runs counted;
-- 'unhold': runs whose units came back; 'recounted': the ids; 'pause_equal': keys paused.
local ready_key, seq_key, marker_key, limdef_key, lims_key, gwait_key, gmem_key, gactive_key, gdelay_key,
  gblock_key, grr_key, kpark_key, kqueued_key, held_key, holds_key, tat_key, tatrem_key, kpause_key,
  recount_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18], KEYS[19]

-- @include ready_score
-- @include groups
-- @include gcra

local WAKE_MOST = 1000
local op = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function woke(count)
  if count > 0 then
    redis.call('ZADD', marker_key, 0, 'ready')
  end
  return count
end

if op == 'define' then
  local count = 0
  for i = 2, #ARGV, 2 do
    redis.call('HSET', limdef_key, ARGV[i], ARGV[i + 1])
    -- Every key of the limit: the `limit \0 key \0 turn \0 group` members of kpark.
    local name = ARGV[i]
    local parked = redis.call('ZRANGE', kpark_key, '[' .. name .. '\0', '(' .. name .. '\1', 'BYLEX', 'LIMIT', 0,
      WAKE_MOST)
    for _, member in ipairs(parked) do
      redis.call('ZREM', kpark_key, member)
      local key_end = string.find(member, '\0', #name + 2, true)
      wake(string.sub(member, key_end + 18))
    end
    count = count + #parked
  end
  return woke(count)
elseif op == 'undefine' then
  local count = 0
  for i = 2, #ARGV do
    count = count + redis.call('HDEL', limdef_key, ARGV[i])
  end
  return count
elseif op == 'pause' then
  local ms = tonumber(ARGV[4])
  local until_ms = ms < 0 and 4503599627370496 or now + ms
  -- Ended pauses are dropped when a run meets them; drop a few others here, so keys paused once
  -- and never used again cost no memory.
  for _, stale in ipairs(redis.call('ZRANGE', kpause_key, '-inf', string.format('%.0f', now), 'BYSCORE', 'LIMIT', 0, 4)) do
    redis.call('ZREM', kpause_key, stale)
  end
  redis.call('ZADD', kpause_key, string.format('%.0f', until_ms), lk_of(ARGV[2], ARGV[3]))
  return until_ms
elseif op == 'resume' then
  local lk = lk_of(ARGV[2], ARGV[3])
  redis.call('ZREM', kpause_key, lk)
  return woke(wake_key(lk, WAKE_MOST))
elseif op == 'state' then
  local lk = lk_of(ARGV[2], ARGV[3])
  local running = tonumber(redis.call('HGET', held_key, lk) or '0')
  local queued = tonumber(redis.call('HGET', kqueued_key, lk) or '0')
  local paused = tonumber(redis.call('ZSCORE', kpause_key, lk) or '-1')
  if paused <= now then
    paused = -1
  end
  local next_ms = -1
  local raw = redis.call('HGET', limdef_key, ARGV[2])
  if raw then
    local d = cjson.decode(raw)
    local o = type(d.o) == 'table' and d.o[ARGV[3]]
    local limit, burst = tonumber(d.l), tonumber(d.b)
    if o then
      limit, burst = tonumber(o[1]), tonumber(o[2])
    end
    if limit > 0 and d.k == 'c' then
      if running == 0 or running < limit then
        next_ms = now
      end
    elseif limit > 0 then
      local _, _, _, retry = gcra(tonumber(redis.call('ZSCORE', tat_key, lk) or '0'),
        tonumber(redis.call('HGET', tatrem_key, lk) or '0'), now, limit, tonumber(d.p), burst, 1)
      next_ms = now + retry
    end
    if next_ms >= 0 and paused >= 0 then
      next_ms = math.max(next_ms, paused)
    end
  end
  return {running, queued, next_ms, paused, now}
elseif op == 'blocked' then
  local out = {}
  for i = 2, #ARGV do
    local id = ARGV[i]
    local member = redis.call('HGET', gmem_key, id)
    if member then
      local group = string.sub(member, 1, #member - #id - 18)
      local rec = block_of(group)
      if rec and rec.w ~= '1' then
        out[#out + 1] = id
        out[#out + 1] = rec.l
        out[#out + 1] = rec.k
        out[#out + 1] = rec.s
        out[#out + 1] = rec.c
      end
    end
  end
  return out
elseif op == 'hold' then
  local count = 0
  for i = 2, #ARGV, 2 do
    local id, group = ARGV[i], ARGV[i + 1]
    if redis.call('HEXISTS', holds_key, id) == 0 and redis.call('HEXISTS', lims_key, id) == 0 then
      local holds = {}
      for _, e in ipairs(group_entries(group)) do
        local raw = redis.call('HGET', limdef_key, e[1])
        -- Rate keys hold nothing; a limit without a definition is counted as a cap (the caller
        -- puts definitions first): counting a unit too many delays a run, one too few breaks a cap.
        if not raw or cjson.decode(raw).k == 'c' then
          local lk = lk_of(e[1], e[2])
          holds[#holds + 1] = {lk, tonumber(e[3])}
          redis.call('HINCRBY', held_key, lk, tonumber(e[3]))
        end
      end
      if #holds > 0 then
        redis.call('HSET', holds_key, id, encode_holds(holds))
        redis.call('ZADD', recount_key, now, id)
        count = count + 1
      end
    end
  end
  return count
elseif op == 'unhold' then
  local count, woken = 0, 0
  for i = 2, #ARGV do
    if redis.call('ZREM', recount_key, ARGV[i]) == 1 then
      count = count + 1
      if return_units(ARGV[i]) then
        woken = woken + 1
      end
    end
  end
  woke(woken)
  return count
elseif op == 'pause_equal' then
  local until_ms, wanted, count = now + tonumber(ARGV[2]), string.lower(ARGV[3]), 0
  for i = 4, #ARGV do
    local group = any_limits() and redis.call('HGET', lims_key, ARGV[i])
    if group then
      for _, e in ipairs(group_entries(group)) do
        if string.lower(e[2]) == wanted then
          count = count + redis.call('ZADD', kpause_key, 'GT', 'CH', string.format('%.0f', until_ms), lk_of(e[1], e[2]))
        end
      end
    end
  end
  return count
elseif op == 'recounted' then
  return redis.call('ZRANGE', recount_key, 0, 9999)
end
return redis.error_reply('unknown operation ' .. tostring(op))

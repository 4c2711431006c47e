-- KEYS[1]=ready KEYS[2]=processing KEYS[3]=priority KEYS[4]=data KEYS[5]=deliveries KEYS[6]=lease
-- KEYS[7]=owner KEYS[8]=lease_seq KEYS[9]=marker KEYS[10]=delayed KEYS[11]=seq KEYS[12]=solo
-- KEYS[13]=drainer KEYS[14]=limdef KEYS[15]=lims KEYS[16]=gwait KEYS[17]=gmem KEYS[18]=gactive
-- KEYS[19]=gdelay KEYS[20]=gblock KEYS[21]=grr KEYS[22]=kpark KEYS[23]=kqueued KEYS[24]=held
-- KEYS[25]=holds KEYS[26]=tat KEYS[27]=tatrem KEYS[28]=kpause KEYS[29]=reservers KEYS[30]=reserving
-- ARGV[1]=worker id ARGV[2]=visibility timeout in ms ARGV[3]=most items to take
-- ARGV[4]=most due delayed items to promote first
-- ARGV[5]=reserve window in ms (0: reserve nothing) ARGV[6]=most delayed items to reserve
-- ARGV[7]=1 when the caller is idle (it holds no run at all), else 0
-- ARGV[8]=reservations the caller holds that are not due yet (its fair share counts them)
-- Returns: {} when nothing was leased, nothing is delayed and no solo item waits for the caller;
-- {wait_ms, drain} when nothing was leased: wait_ms is how long until the earliest delayed item the
-- caller may take is due (Redis clock, as a duration; with reservations on, until it comes within
-- the window), -1 when there is none; drain is 1 when the caller skipped a solo item and is now its
-- drainer (see below), else 0. Otherwise {deadline_ms, flags, leased_ms, id, token, data, priority,
-- deliveries, due_in_ms, id, ...}: the best ready items, best first, then the reserved items in due
-- order, each now leased to the worker until deadline_ms (Redis clock); flags is 1 (drain, as
-- above) + 2 (the reply's one lease is a solo delivery). leased_ms is the instant of every lease of
-- the reply (Redis clock, whole ms): the one clock reading this call admits on (limits) and counts
-- the deadline from, so a run's recorded start can be the instant its limits admitted it.
-- due_in_ms is -1 for a ready item; for a reserved one, how long until it is due (Redis clock, as a
-- duration: no host clock matters).
-- Delayed items whose due time has passed are promoted to ready first (up to ARGV[4]), so a worker
-- takes work at its due time without waiting for the leader's promote loop.
-- Reservations: when the ready items do not fill ARGV[3], delayed items due within the window (up
-- to ARGV[6]) are leased too, taken out of the delayed set: the worker claims them ahead and
-- starts each at its due time.
-- Fair shares: while more than one worker reserves from the queue (reservers: the worker of each
-- reserving call made while items are delayed, forgotten RESERVER_TTL_MS after its last), a caller
-- takes at most its share of the window, ceil((delayed items within it + reservations not due yet)
-- / reservers), less the reservations it holds (ARGV[8]); reserving records each reservation until
-- its due time. So a crowd due at one instant starts on every worker side by side, not mostly on
-- the first to wake (each worker starts its share one run after another). Within window / 3 of the
-- earliest item's due time the shares end, and whoever asks takes what is left (a reserver that
-- went away, or held more than it said, strands nothing). A caller kept out by its share comes
-- back then.
-- Solo items (the solo set: items that stalled max_stalls - 1 times, see queue_recover) are leased
-- only to an idle caller, one alone (a solo delivery, its token ending in 's'), so a worker that dies
-- during it died of that item. Other callers skip them, keeping their place; one of those, the
-- drainer (SET NX for a visibility timeout), is told to become idle. Nobody reserves one. With the
-- solo set empty the only extra cost is one SCARD.
-- Limits (issue 22, see _groups.lua): runs with limit keys wait in their group's backlog, not in
-- ready. When any item of the queue carries limit keys (one EXISTS tells; otherwise nothing below
-- runs), parked groups whose time has come are woken, and the active groups are served round-robin,
-- merged with ready by ready score: the next group's best run is taken when it beats ready's best
-- (priority, then FIFO), and only when each of its limit keys admits its units (a concurrency key:
-- units held + its units <= limit, or none held; a rate key: GCRA, see _gcra.lua; a paused key:
-- never). Taking the units (held, the run's holds record, the GCRA TAT) is part of the lease. A
-- group found blocked is parked: on its key (kpark) when a concurrency unit, a pause or a missing
-- definition blocks it, and in gdelay until the GCRA retry time or the pause's end; gblock records
-- why and since when. At most count + 8 group turns are spent per call; parked groups cost nothing.
-- A key that still has room after an admission, or that had room for a group parked on another key,
-- wakes one more group parked on it, so no free unit is left with groups asleep on it.
-- Safe to resend only under the resend guard (queue.py wraps it): it leases what it pops.
local ready_key, processing_key, priority_key, data_key, deliveries_key, lease_key, owner_key,
  lease_seq_key, marker_key, delayed_key, seq_key, solo_key, drainer_key, limdef_key, lims_key, gwait_key,
  gmem_key, gactive_key, gdelay_key, gblock_key, grr_key, kpark_key, kqueued_key, held_key, holds_key,
  tat_key, tatrem_key, kpause_key, reservers_key, reserving_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11],
  KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18], KEYS[19], KEYS[20], KEYS[21],
  KEYS[22], KEYS[23], KEYS[24], KEYS[25], KEYS[26], KEYS[27], KEYS[28], KEYS[29], KEYS[30]

-- @include ready_score
-- @include groups
-- @include promote_due
-- @include gcra

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

-- Whether any item carries limit keys: the one check the queue without limits pays.
local limited = any_limits()
local grouped = false
if limited then
  if not t then
    read_clock()
  end
  promote_groups(now, tonumber(ARGV[4]))
  grouped = redis.call('ZCARD', gactive_key) > 0
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
    elseif not redis.call('ZSCORE', delayed_key, id) and redis.call('HEXISTS', gmem_key, id) == 0 then
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

-- A pause with no end, in ms: far beyond any clock, below 2^53.
local FOREVER = 4503599627370496
local MAX_EXTRA_TURNS = 8

local definitions = {}
local function definition(limit)
  local d = definitions[limit]
  if d == nil then
    local raw = redis.call('HGET', limdef_key, limit)
    d = raw and cjson.decode(raw) or false
    definitions[limit] = d
  end
  return d
end

-- Try to admit the run `id` of `group`. Admitted: its units are taken, and the result is nil plus
-- the concurrency keys that still have room. Refused: nothing is taken, and the result is the block
-- that parks the group, {kind, limit, key, until_ms or nil} (kind 'p' paused > 'u' no definition or
-- a limit of 0 > 'c' concurrency > 'r' rate, the latest retry among rates), plus the concurrency
-- keys that had room.
local RANK = {p = 4, u = 3, c = 2, r = 1}
local paused_seen, blocked_seen
local function any_blocked()
  if blocked_seen == nil then
    blocked_seen = redis.call('EXISTS', gblock_key) == 1
  end
  return blocked_seen
end
local function any_paused()
  if paused_seen == nil then
    paused_seen = redis.call('EXISTS', kpause_key) == 1
  end
  return paused_seen
end
-- The end (ms) of the pause of limit key `lk` while it lasts, else nil; a pause that has ended is
-- dropped here, so the key is admitted as if never paused.
local function pause_until(lk)
  local paused = any_paused() and redis.call('ZSCORE', kpause_key, lk)
  if not paused then
    return nil
  end
  if tonumber(paused) > now then
    return tonumber(paused)
  end
  redis.call('ZREM', kpause_key, lk)
  return nil
end
-- An entry's definition, and its limit and burst for the entry's key (an override, else the
-- definition's); nil when the limit has no definition.
local function limit_of(e)
  local d = definition(e[1])
  if not d then
    return nil
  end
  local o = type(d.o) == 'table' and d.o[e[2]]
  if o then
    return d, tonumber(o[1]), tonumber(o[2])
  end
  return d, tonumber(d.l), tonumber(d.b)
end
local tats_pruned = false
local function prune_tats()
  if not tats_pruned then
    -- A TAT in the past is the same as none: drop a few, so keys no longer used cost no memory.
    tats_pruned = true
    for _, stale in ipairs(redis.call('ZRANGE', tat_key, '-inf', string.format('(%.0f', now), 'BYSCORE', 'LIMIT', 0, 4)) do
      redis.call('ZREM', tat_key, stale)
      redis.call('HDEL', tatrem_key, stale)
    end
  end
end
local function save_tat(lk, tat_ms, tat_rem)
  redis.call('ZADD', tat_key, string.format('%.0f', tat_ms), lk)
  if tat_rem > 0 then
    redis.call('HSET', tatrem_key, lk, string.format('%.0f', tat_rem))
  else
    redis.call('HDEL', tatrem_key, lk)
  end
end
local function admit(id, group)
  local block
  local function refuse(kind, e, until_ms)
    if not block or RANK[kind] > RANK[block[1]] or (kind == block[1] and (until_ms or 0) > (block[4] or 0)) then
      block = {kind, e[1], e[2], until_ms}
    end
  end
  local holds, rates, room = {}, {}, {}
  for _, e in ipairs(group_entries(group)) do
    local lk = lk_of(e[1], e[2])
    local units = tonumber(e[3])
    local paused_until = pause_until(lk)
    if paused_until then
      refuse('p', e, paused_until)
    else
      local d, limit, burst = limit_of(e)
      if not d or limit <= 0 then
        refuse('u', e, nil)
      elseif d.k == 'c' then
        local held = tonumber(redis.call('HGET', held_key, lk) or '0')
        if held > 0 and held + units > limit then
          refuse('c', e, nil)
        else
          holds[#holds + 1] = {lk, units}
          room[#room + 1] = {lk, held + units < limit}
        end
      else
        local ok, tat_ms, tat_rem, retry = gcra(tonumber(redis.call('ZSCORE', tat_key, lk) or '0'),
          tonumber(redis.call('HGET', tatrem_key, lk) or '0'), now, limit, tonumber(d.p), burst, units)
        if ok then
          rates[#rates + 1] = {lk, tat_ms, tat_rem}
        else
          refuse('r', e, now + retry)
        end
      end
    end
  end
  if block then
    return block, room
  end
  for _, h in ipairs(holds) do
    redis.call('HINCRBY', held_key, h[1], h[2])
  end
  if #holds > 0 then
    redis.call('HSET', holds_key, id, encode_holds(holds))
  end
  if #rates > 0 then
    prune_tats()
  end
  for _, r in ipairs(rates) do
    save_tat(r[1], r[2], r[3])
  end
  return nil, room
end

-- Admit up to `n` runs of `group` at once, as `admit` run by run would (every run of a group takes
-- the same units of the same keys): how many in a row every key admits, their units taken (held,
-- one holds record each, the GCRA TAT advanced once per run). Returns that count (0: nothing
-- taken; `admit` then finds the block) and the group's holds record (nil without concurrency keys).
-- Only for a group no other group competes with for a turn (see take_merged), so no per-run turn or
-- wake is skipped.
local function admit_many(group, n)
  local conc, rates = {}, {}
  for _, e in ipairs(group_entries(group)) do
    local lk = lk_of(e[1], e[2])
    local units = tonumber(e[3])
    if pause_until(lk) then
      return 0
    end
    local d, limit, burst = limit_of(e)
    if not d or limit <= 0 then
      return 0
    end
    if d.k == 'c' then
      local held = tonumber(redis.call('HGET', held_key, lk) or '0')
      local fit = 0
      while fit < n and not (held > 0 and held + units > limit) do
        held = held + units
        fit = fit + 1
      end
      n = fit
      conc[#conc + 1] = {lk, units}
    else
      local tat0_ms = tonumber(redis.call('ZSCORE', tat_key, lk) or '0')
      local tat0_rem = tonumber(redis.call('HGET', tatrem_key, lk) or '0')
      local tat_ms, tat_rem = tat0_ms, tat0_rem
      local fit = 0
      while fit < n do
        local ok, next_ms, next_rem = gcra(tat_ms, tat_rem, now, limit, tonumber(d.p), burst, units)
        if not ok then
          break
        end
        tat_ms, tat_rem = next_ms, next_rem
        fit = fit + 1
      end
      n = fit
      rates[#rates + 1] = {lk, limit, tonumber(d.p), burst, units, tat0_ms, tat0_rem}
    end
    if n == 0 then
      return 0
    end
  end
  for _, c in ipairs(conc) do
    redis.call('HINCRBY', held_key, c[1], n * c[2])
  end
  if #rates > 0 then
    prune_tats()
  end
  for _, r in ipairs(rates) do
    -- Again from the TAT read above, exactly n admissions (a later key may have admitted fewer).
    local tat_ms, tat_rem = r[6], r[7]
    for _ = 1, n do
      local _, next_ms, next_rem = gcra(tat_ms, tat_rem, now, r[2], r[3], r[4], r[5])
      tat_ms, tat_rem = next_ms, next_rem
    end
    save_tat(r[1], tat_ms, tat_rem)
  end
  return n, #conc > 0 and encode_holds(conc) or nil
end

-- Park a group found blocked (see the header), keeping since when it waits for the same key.
local function park(group, block)
  redis.call('ZREM', gactive_key, group)
  local kind, limit, key, until_ms = block[1], block[2], block[3], block[4]
  local since = string.format('%.0f', now)
  local rec = block_of(group)
  if rec then
    if rec.m ~= '' then
      redis.call('ZREM', kpark_key, rec.m)
    end
    if rec.l == limit and rec.k == key then
      since = rec.s
    end
  end
  local member = ''
  if kind ~= 'r' then
    member = lk_of(limit, key) .. '\0' .. pad16(string.format('%d', redis.call('INCR', grr_key))) .. '\0' .. group
    redis.call('ZADD', kpark_key, 0, member)
    parked_seen = true
  end
  if until_ms and until_ms < FOREVER then
    redis.call('ZADD', gdelay_key, string.format('%.0f', until_ms), group)
  else
    redis.call('ZREM', gdelay_key, group)
  end
  redis.call('HSET', gblock_key, group, cjson.encode({l = limit, k = key, s = since, c = kind, m = member, w = '0'}))
  blocked_seen = true
end

-- The turns of a group that is the only one active, taken at once (see take_merged): its best
-- `members` (up to `most` of them, the ones that beat ready's best score `rscore`), as many in a
-- row as its keys admit (admit_many), each leased as its own turn would. Returns how many were
-- taken (0: none admitted, nothing changed but expired pauses dropped). Per run: two string cuts
-- and one field of two variadic calls; the backlog loses its first n members in one range.
local function take_batch(group, members, most, rscore)
  local sub = string.sub
  local from = #group + 19
  local want = math.min(most, #members)
  if rscore then
    for i = 1, want do
      if member_score(group, members[i]) > rscore then
        want = i - 1
        break
      end
    end
  end
  local n, holds = admit_many(group, want)
  if n == 0 then
    return 0
  end
  local ids, args = {}, {}
  local p = #popped
  for i = 1, n do
    local id = sub(members[i], from)
    ids[i] = id
    -- (a popped score is never read again: no number is made of it)
    popped[p + 1] = id
    popped[p + 2] = 0
    p = p + 2
    if holds then
      args[2 * i - 1] = id
      args[2 * i] = holds
    end
  end
  if holds then
    redis.call('HSET', holds_key, unpack(args))
  end
  -- Nothing sorts between the group's first member and its n-th but the n-1 others.
  redis.call('ZREMRANGEBYLEX', gwait_key, '[' .. group .. '\0', '[' .. members[n])
  redis.call('HDEL', gmem_key, unpack(ids))
  group_count(group, -n)
  if any_blocked() then
    redis.call('HDEL', gblock_key, group)
  end
  if n < #members then
    redis.call('ZADD', gactive_key, 'XX', redis.call('INCR', grr_key), group)
  else
    redis.call('ZREM', gactive_key, group)
  end
  return n
end

-- Ready's head (`head`, from ZRANGE WITHSCORES) merged with the active groups, round-robin, into
-- `popped`; a solo run at a group's head goes to an idle caller alone (`solo_id`). A group that is
-- the only one active, with no solo item anywhere and no group parked on any key (so no run's
-- admission could wake one), would get every turn in a row until ready's best beats its best or
-- a key refuses: those turns are taken at once (take_batch), one range read and one write per key
-- for all of them, so a lone group's drain costs about what ready's does.
local function take_merged(head)
  local hi = 1
  local turns = 0
  while #popped < 2 * count do
    while hi <= #head and is_solo(head[hi]) do
      skipped = true
      hi = hi + 2
    end
    local rid, rscore = head[hi], head[hi] and tonumber(head[hi + 1])
    local group, members, most
    if turns < count + MAX_EXTRA_TURNS then
      local active = redis.call('ZRANGE', gactive_key, 0, 1)
      group = active[1]
      if group then
        if #active == 1 and solo_count == 0 and not any_parked() then
          most = math.min(count - #popped / 2, count + MAX_EXTRA_TURNS - turns)
        end
        members = group_items(group, (most or 1) + 1)
      end
    end
    local member, gid, gscore, more
    if group then
      member = members[1]
      if member then
        gid, gscore, more = member_id(group, member), member_score(group, member), #members > 1
      else
        turns = turns + 1
        drop_group(group)
      end
    end
    local batch = 0
    if member and most and not (rid and rscore < gscore) then
      batch = take_batch(group, members, most, rid and rscore)
      turns = turns + batch
    end
    if batch > 0 then
      -- taken: look again
    elseif member and not (rid and rscore < gscore) then
      turns = turns + 1
      local turn = redis.call('INCR', grr_key)
      if is_solo(gid) and not (idle and #popped == 0) then
        skipped = true
        redis.call('ZADD', gactive_key, 'XX', turn, group)
      else
        local block, room = admit(gid, group)
        if block then
          park(group, block)
        else
          redis.call('ZREM', gwait_key, member)
          redis.call('HDEL', gmem_key, gid)
          group_count(group, -1)
          if any_blocked() then
            redis.call('HDEL', gblock_key, group)
          end
          if more then
            redis.call('ZADD', gactive_key, 'XX', turn, group)
          else
            redis.call('ZREM', gactive_key, group)
          end
          if is_solo(gid) then
            redis.call('SREM', solo_key, gid)
            solo_id = gid
          else
            popped[#popped + 1] = gid
            popped[#popped + 1] = gscore
          end
        end
        -- Pass the baton: a key with room left wakes one more group parked on it.
        for _, r in ipairs(room) do
          if r[2] or block then
            wake_key(r[1], 1)
          end
        end
        if solo_id then
          break
        end
      end
    elseif not member and group then
      -- an emptied group was dropped: look again
    elseif rid then
      redis.call('ZREM', ready_key, rid)
      popped[#popped + 1] = rid
      popped[#popped + 1] = rscore
      hi = hi + 2
    else
      break
    end
  end
end

if solo_count == 0 and not grouped then
  popped = redis.call('ZPOPMIN', ready_key, count)
else
  if idle and solo_count > 0 then
    solo_id = take_best_solo()
  end
  -- At most skip_span of these are solo, so the rest fill the request when ready holds enough.
  local head = not solo_id and redis.call('ZRANGE', ready_key, 0, count + skip_span - 1, 'WITHSCORES') or {}
  if grouped and not solo_id then
    take_merged(head)
  elseif not solo_id then
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

-- The most this caller may reserve now: its fair share of the window, less what it holds (see
-- the header); every reserving caller is noted as a reserver.
local RESERVER_TTL_MS = 5000
local shared_out = false -- kept from reserving by its share: it comes back when the shares end
local function fair_share(most)
  redis.call('ZREMRANGEBYSCORE', reservers_key, '-inf', now - RESERVER_TTL_MS)
  redis.call('ZREMRANGEBYSCORE', reserving_key, '-inf', now)
  local reservers = redis.call('ZCARD', reservers_key)
  if reservers < 2 or tonumber(earliest[2]) <= now + window / 3 then
    return most
  end
  local within = redis.call('ZCOUNT', delayed_key, '-inf', string.format('%.0f', now + window))
  local share = math.ceil((within + redis.call('ZCARD', reserving_key)) / reservers)
  local room = math.max(0, share - tonumber(ARGV[8]))
  if room < most then
    most = room
    shared_out = room == 0
  end
  return most
end

-- Ready items first: reserve only when they leave the request unfilled (a draining worker pays
-- nothing), and only when the earliest delayed item is within the window (else no range read).
local reserved = {}
if reserving and #earliest > 0 then
  redis.call('ZADD', reservers_key, now, worker)
  redis.call('PEXPIRE', reservers_key, RESERVER_TTL_MS)
end
local reservable = not solo_id and reserving and #popped < 2 * count and #earliest > 0
  and tonumber(earliest[2]) <= now + window
if reservable then
  reserve_most = fair_share(reserve_most)
end
if reservable and reserve_most > 0 then
  local found = redis.call('ZRANGE', delayed_key, '-inf', string.format('%.0f', now + window), 'BYSCORE',
    'LIMIT', 0, reserve_most + skip_span, 'WITHSCORES')
  if solo_count == 0 and not limited then
    reserved = found
  else
    -- Nor is a run with limit keys reserved: it must pass its group's admission when due.
    for i = 1, #found, 2 do
      if #reserved < 2 * reserve_most and not is_solo(found[i])
          and not (limited and redis.call('HEXISTS', lims_key, found[i]) == 1) then
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
  if grouped and redis.call('ZCARD', gactive_key) > 0 then
    return true
  end
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
  if (solo_count > 0 or limited) and #earliest > 0 then
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
    if not solo and reserving and not (limited and redis.call('HEXISTS', lims_key, head[i]) == 1) then
      -- Kept out by its share: back when the shares end (or when an enqueue wakes it).
      due = due - (shared_out and window / 3 or window)
    end
    if (idle or not solo) and (not ahead or due < ahead) then
      ahead = due
    end
  end
  if limited then
    -- A parked group wakes at its rate retry time or pause end (see _groups.lua).
    local parked = redis.call('ZRANGE', gdelay_key, 0, 0, 'WITHSCORES')
    if #parked > 0 and (not ahead or tonumber(parked[2]) - now < ahead) then
      ahead = tonumber(parked[2]) - now
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

local out = {deadline, (drain() and 1 or 0) + (solo_id and 2 or 0), string.format('%.0f', now)}
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
  redis.call('ZADD', reserving_key, reserved[i + 1], reserved[i])
  lease(reserved[i], math.max(0, tonumber(reserved[i + 1]) - now), '')
end
if #reserved > 0 then
  redis.call('PEXPIRE', reserving_key, window + 1000)
end

-- BullMQ's marker pattern: work is left, so wake another idle worker; otherwise nobody should wake.
-- Reserved items count as work left while more are within the window: the other workers sleep
-- until the window reaches the earliest item they knew of, and without this wake the first caller
-- would reserve a whole instant's runs alone (their starts one after another on one worker).
local function reservable_left()
  if #reserved == 0 then
    return false
  end
  local next_delayed = redis.call('ZRANGE', delayed_key, 0, 0, 'WITHSCORES')
  return #next_delayed > 0 and tonumber(next_delayed[2]) <= now + window
end

if work_left() or reservable_left() then
  redis.call('ZADD', marker_key, 0, 'ready')
else
  redis.call('DEL', marker_key)
end
return out

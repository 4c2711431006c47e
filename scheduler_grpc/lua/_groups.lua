-- Shared by every queue script that makes an item wait, or ends a lease, when items may carry limit
-- keys (issue 22); "@include groups" goes after "@include ready_score", once the script has bound
-- `ready_key`, `seq_key`, `lims_key`, `gwait_key`, `gmem_key`, `gactive_key`, `gdelay_key`,
-- `gblock_key`, `grr_key`, `kpark_key`, `kqueued_key`, `held_key` and `holds_key`.
-- An item with limits never enters ready: it waits in its group (the canonical JSON of its sorted
-- limit keys, made by gcra.py `encode_group` and never re-encoded here), as a member
-- `group \0 ready-score (16 digits) \0 id` of the lex-ordered gwait set, so one BYLEX range reads a
-- group's best item. A group is active (gactive, scored by its round-robin turn), parked (gblock
-- says why; on a key in kpark, members `limit \0 key \0 turn (16 digits) \0 group`, FIFO per key,
-- and/or in gdelay until a time), or neither while empty. A key text has no NUL (PostgreSQL's jsonb
-- cannot hold one; the queue refuses it) and a group string no control character (JSON escapes
-- them), so those separators and the '\1' range ends are unambiguous.

-- Whether any item of the queue carries limit keys, read once per script call: a queue without
-- limits pays this one EXISTS per call, not a lookup per item.
local limits_seen
local function any_limits()
  if limits_seen == nil then
    limits_seen = redis.call('EXISTS', lims_key) == 1
  end
  return limits_seen
end

local function pad16(digits)
  return string.rep('0', 16 - #digits) .. digits
end

local function lk_of(limit, key)
  return limit .. '\0' .. key
end

local decoded_groups = {}
local function group_entries(group)
  local entries = decoded_groups[group]
  if not entries then
    entries = cjson.decode(group)
    decoded_groups[group] = entries
  end
  return entries
end

-- Queued runs per key (of groups that contain it), for key_state.
local function group_count(group, delta)
  for _, e in ipairs(group_entries(group)) do
    local lk = lk_of(e[1], e[2])
    if redis.call('HINCRBY', kqueued_key, lk, delta) <= 0 then
      redis.call('HDEL', kqueued_key, lk)
    end
  end
end

local function block_of(group)
  local rec = redis.call('HGET', gblock_key, group)
  return rec and cjson.decode(rec) or nil
end

-- To the back of the round-robin (a group already active keeps its turn).
local function activate(group)
  redis.call('ZADD', gactive_key, 'NX', redis.call('INCR', grr_key), group)
end

-- Put `id` in its group's backlog with `score` (a ready score). Returns true when the group is
-- active (not parked), so a worker should wake for it.
local function group_add(id, group, score)
  local member = group .. '\0' .. pad16(score) .. '\0' .. id
  redis.call('ZADD', gwait_key, 0, member)
  redis.call('HSET', gmem_key, id, member)
  group_count(group, 1)
  if redis.call('ZSCORE', gactive_key, group) then
    return true
  end
  local rec = block_of(group)
  if rec and rec.w ~= '1' then
    return false
  end
  activate(group)
  return true
end

-- Make a waiting item ready with its priority: into ready, or into its group when it has limits.
-- Returns true when a worker should wake for it.
local function make_ready(id, priority)
  local group = any_limits() and redis.call('HGET', lims_key, id)
  if group then
    return group_add(id, group, ready_score(priority))
  end
  redis.call('ZADD', ready_key, ready_score(priority), id)
  return true
end

-- The `most` best waiting members of a group (one BYLEX range: O(log n) however long the backlog).
local function group_items(group, most)
  return redis.call('ZRANGE', gwait_key, '[' .. group .. '\0', '(' .. group .. '\1', 'BYLEX', 'LIMIT', 0, most)
end

-- A gwait member's id and ready score.
local function member_id(group, member)
  return string.sub(member, #group + 19)
end
local function member_score(group, member)
  return tonumber(string.sub(member, #group + 2, #group + 17))
end

-- The best waiting item of a group: member, id, ready score, and whether another waits behind it;
-- nil when the group is empty.
local function group_head(group)
  local head = group_items(group, 2)
  if #head == 0 then
    return nil
  end
  local member = head[1]
  return member, member_id(group, member), member_score(group, member), #head > 1
end

-- Unpark a group (it stays "woken" in gblock, keeping why and since when it waited, until a run of
-- it is admitted) and make it active. Returns true unless it was active already.
local function wake(group)
  local rec = block_of(group)
  if rec and rec.w == '1' then
    return false
  end
  if rec then
    if rec.m ~= '' then
      redis.call('ZREM', kpark_key, rec.m)
    end
    rec.m = ''
    rec.w = '1'
    redis.call('HSET', gblock_key, group, cjson.encode(rec))
  end
  redis.call('ZREM', gdelay_key, group)
  activate(group)
  return true
end

-- Whether any group is parked on a key, read once per script call (parking in this call sets it).
local parked_seen
local function any_parked()
  if parked_seen == nil then
    parked_seen = redis.call('EXISTS', kpark_key) == 1
  end
  return parked_seen
end

-- Wake up to `most` groups parked on a key, longest parked first. Returns how many woke.
local function wake_key(lk, most)
  if not any_parked() then
    return 0
  end
  local parked = redis.call('ZRANGE', kpark_key, '[' .. lk .. '\0', '(' .. lk .. '\1', 'BYLEX', 'LIMIT', 0, most)
  for _, member in ipairs(parked) do
    redis.call('ZREM', kpark_key, member)
    wake(string.sub(member, #lk + 19))
  end
  return #parked
end

-- Wake the groups whose parked time has come (rate retry times, pause ends). Returns how many.
local function promote_groups(now, most)
  local due = redis.call('ZRANGE', gdelay_key, '-inf', string.format('%.0f', now), 'BYSCORE', 'LIMIT', 0, most)
  for _, group in ipairs(due) do
    wake(group)
  end
  return #due
end

-- Forget a group that has no waiting item left.
local function drop_group(group)
  local rec = block_of(group)
  if rec and rec.m ~= '' then
    redis.call('ZREM', kpark_key, rec.m)
  end
  redis.call('ZREM', gdelay_key, group)
  redis.call('ZREM', gactive_key, group)
  redis.call('HDEL', gblock_key, group)
end

-- Take a waiting item out of its group's backlog (the group is forgotten when emptied). Returns
-- true if it was waiting in a group.
local function group_remove(id)
  local member = redis.call('HGET', gmem_key, id)
  if not member then
    return false
  end
  redis.call('ZREM', gwait_key, member)
  redis.call('HDEL', gmem_key, id)
  local group = string.sub(member, 1, #member - #id - 18)
  group_count(group, -1)
  if not group_head(group) then
    drop_group(group)
  end
  return true
end

-- Whether the item carries limit keys (one EXISTS per call when none does).
local function has_limits(id)
  return any_limits() and redis.call('HEXISTS', lims_key, id) == 1
end

-- A holds record: JSON [[lk, units], ...], padded with spaces (JSON whitespace) past the longest
-- value Valkey keeps in a listpack hash (hash-max-listpack-value, 64 by default). The holds hash
-- has a field per leased run, hundreds on a busy queue, and as a listpack each HSET, HMGET and
-- HDEL would scan it and move its tail: the padding keeps it a hash table (O(1) per field).
local HOLDS_PAD = string.rep(' ', 65)
local function encode_holds(holds)
  local rec = cjson.encode(holds)
  if #rec > 64 then
    return rec
  end
  return rec .. string.sub(HOLDS_PAD, #rec)
end

-- Give back the concurrency units the runs `ids` hold (their holds records, deleted here: a second
-- call finds none, so every return happens once) and wake, per unit, a group parked on each key:
-- the units of all of them summed per key (each distinct record decoded once), one HINCRBY and one
-- wake per key (the groups woken are the ones the returns one by one would wake). Returns true
-- when a group woke.
local function return_units_many(ids)
  if #ids == 0 then
    return false
  end
  local recs = redis.call('HMGET', holds_key, unpack(ids))
  local holders, held_by, times = {}, {}, {}
  local h = 0
  for i = 1, #ids do
    local rec = recs[i]
    if rec then
      h = h + 1
      holders[h] = ids[i]
      local seen = times[rec]
      if seen then
        times[rec] = seen + 1
      else
        held_by[#held_by + 1] = rec
        times[rec] = 1
      end
    end
  end
  if h == 0 then
    return false
  end
  redis.call('HDEL', holds_key, unpack(holders))
  local keys, units_of = {}, {}
  for _, rec in ipairs(held_by) do
    for _, e in ipairs(cjson.decode(rec)) do
      local lk = e[1]
      if not units_of[lk] then
        keys[#keys + 1] = lk
        units_of[lk] = 0
      end
      units_of[lk] = units_of[lk] + tonumber(e[2]) * times[rec]
    end
  end
  local woke = false
  for _, lk in ipairs(keys) do
    local units = units_of[lk]
    if redis.call('HINCRBY', held_key, lk, -units) <= 0 then
      redis.call('HDEL', held_key, lk)
    end
    if wake_key(lk, units) > 0 then
      woke = true
    end
  end
  return woke
end

-- `return_units_many` of one run.
local function return_units(id)
  return return_units_many({id})
end

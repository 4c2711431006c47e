-- Shared by every queue script that makes an item ready; queue.py inserts it where a script
-- says "@include ready_score", after the script has bound `ready_key`, `seq_key` and `gwait_key`
-- (the group backlogs of runs with limits, ordered by the same scores).
-- Ready score = (PRIORITY_MAX - priority) * SEQ_SPAN + seq: priority desc, then FIFO, exact in a
-- double because 2001 * 2^42 < 2^53. Both constants must match queue.py (a test checks).
local PRIORITY_MAX = 1000
local SEQ_SPAN = 4398046511104

local function ready_score(priority)
  local seq = redis.call('INCR', seq_key)
  if seq > SEQ_SPAN / 2 and redis.call('ZCARD', ready_key) == 0 and redis.call('ZCARD', gwait_key) == 0 then
    -- Nothing waits, so no order needs keeping: restart the counter long before it could overflow.
    redis.call('SET', seq_key, 1)
    seq = 1
  end
  if seq >= SEQ_SPAN then
    error('queue sequence exhausted: drain the ready set once to reset it')
  end
  -- '%.0f' keeps every digit; tostring() would round to 14 significant digits.
  return string.format('%.0f', (PRIORITY_MAX - priority) * SEQ_SPAN + seq)
end

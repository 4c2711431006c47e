-- Shared by the scripts that move due delayed items to ready (queue_promote, queue_dequeue);
-- "@include promote_due" goes after "@include ready_score" and "@include groups", once the script
-- has bound `delayed_key`, `priority_key` and the keys those need.

-- Move up to `limit` delayed items due by `now` (ms, Redis clock) to ready, in due order; each
-- keeps its priority and joins the back of it (an item with limit keys: of its group's backlog).
-- Returns their ids, and whether a worker should wake for them.
local function promote_due(now, limit)
  local due = redis.call('ZRANGE', delayed_key, '-inf', string.format('%.0f', now), 'BYSCORE',
    'LIMIT', 0, limit)
  local wake = false
  for _, id in ipairs(due) do
    redis.call('ZREM', delayed_key, id)
    local priority = tonumber(redis.call('HGET', priority_key, id) or '0')
    if make_ready(id, priority) then
      wake = true
    end
  end
  return due, wake
end

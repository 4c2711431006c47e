-- Shared by the scripts that move due delayed items to ready (queue_promote, queue_dequeue);
-- "@include promote_due" goes after "@include ready_score", once the script has bound
-- `delayed_key`, `ready_key`, `priority_key` and `seq_key`.

-- Move up to `limit` delayed items due by `now` (ms, Redis clock) to ready, in due order; each
-- keeps its priority and joins the back of it. Returns their ids.
local function promote_due(now, limit)
  local due = redis.call('ZRANGE', delayed_key, '-inf', string.format('%.0f', now), 'BYSCORE',
    'LIMIT', 0, limit)
  for _, id in ipairs(due) do
    redis.call('ZREM', delayed_key, id)
    local priority = tonumber(redis.call('HGET', priority_key, id) or '0')
    redis.call('ZADD', ready_key, ready_score(priority), id)
  end
  return due
end

-- Shared by the scripts that admit rate-limited runs (queue_dequeue, queue_limits); the same
-- arithmetic, operation for operation, as scheduler_grpc/gcra.py `decide` (a test runs both on the
-- same inputs). Exact integers in doubles: see gcra.py.

-- floor(a / b) for integers a >= 0, b > 0, exact even where a / b rounds to the next integer.
local function idiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then
    q = q - 1
  elseif r >= b then
    q = q + 1
  end
  return q
end

-- One GCRA admission of `units` at `now` (ms) against the stored TAT (tat_ms, tat_rem); a key never
-- seen is (0, 0). Returns admitted, new tat_ms, new tat_rem, retry_ms (0 when admitted; else the
-- exact wait after which the same request passes, the TAT unchanged).
local function gcra(tat_ms, tat_rem, now, limit, period, burst, units)
  local rem = math.min(tat_rem, limit - 1)
  local ahead = 0
  if tat_ms >= now then
    ahead = (tat_ms - now) * limit + rem
  end
  local cap = (burst + 1) * period
  local cost = units * period
  local after = ahead + cost
  if after <= cap or ahead == 0 then
    local q = idiv(after, limit)
    return true, now + q, after - q * limit, 0
  end
  local slack = math.max(0, cap - cost)
  return false, tat_ms, tat_rem, idiv(ahead - slack + limit - 1, limit)
end

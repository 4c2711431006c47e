-- KEYS[1]=the user's session index (SET of the hex SHA-256 of each session token)
-- KEYS[2..n]=the session keys of (some of) its members, `{auth}:session:<hex>` (STRING, JSON)
-- ARGV[1]=mode: 'role' (re-scope), 'end' (end sessions) or 'prune' (forget members whose session expired)
-- ARGV[2]=the user's version after the change   ARGV[3]=the user's role after it ('role' only)
-- ARGV[4]=a session key that stays ('end' only; '' keeps none)
-- Returns the number of sessions re-scoped or ended.
-- Only sessions older than the change (their `v` below ARGV[2]) are touched: a session opened or
-- re-scoped by a newer change keeps what that change gave it, whatever order the scripts run in.
-- TTLs are kept: a re-scoped session still ends when it would have.
local index, mode, version, role, keep = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local changed = 0
for i = 2, #KEYS do
    local key = KEYS[i]
    local member = string.match(key, '([^:]+)$')
    local raw = redis.call('GET', key)
    if not raw then
        redis.call('SREM', index, member)
    elseif mode ~= 'prune' then
        local session = cjson.decode(raw)
        if (tonumber(session['v']) or 0) < version then
            if mode == 'end' then
                if key ~= keep then
                    redis.call('DEL', key)
                    redis.call('SREM', index, member)
                    changed = changed + 1
                end
            else
                session['role'] = role
                session['v'] = version
                redis.call('SET', key, cjson.encode(session), 'KEEPTTL')
                changed = changed + 1
            end
        end
    end
end
return changed

-- KEYS[1]=failed logins for this username from this address (STRING counter, AuthKeys.failures_by_pair)
-- KEYS[2]=failed logins from this address, any username (STRING counter, AuthKeys.failures_by_peer)
-- KEYS[3]=failed logins for this username, any address (STRING counter, AuthKeys.failures_by_username)
-- KEYS[4]=when this username may next be tried, per lane (HASH clean|suspect -> ms since the epoch,
--         AuthKeys.login_slots)
-- KEYS[5]=exists while this address is known for this username: it logged in with the right password
--         recently (AuthKeys.known_address, set by login_release.lua)
-- ARGV[1]=hard limit per (username, address)   ARGV[2]=hard limit per address
-- ARGV[3]=failures of the username (from anywhere) after which its attempts are spaced
-- ARGV[4]=the first spacing, in ms (doubled with each further failure)   ARGV[5]=the largest spacing, in ms
-- ARGV[6]=the failure window, in ms (the counters expire this long after their first failure)
-- Returns {0, 0}: the attempt is reserved (counted as a failure until login_release.lua undoes it);
-- {1, ms}: refused, this (username, address) is at its limit for `ms` more; {2, ms}: refused, this
-- address is at its limit; {3, ms}: refused, this username's next attempt in this lane is `ms` away.
--
-- Check and count in one script, BEFORE the password is hashed: concurrent attempts cannot all
-- read a count under the limit and all be checked (the race of a read, a slow hash, then a count).
-- The soft per-username spacing has two lanes: an address that has not failed for this username
-- ("clean") never waits behind addresses that have ("suspect"), so guessing from elsewhere cannot
-- keep the right password from a clean address out; and an address known for this username (one
-- it recently logged in from) is never spaced at all, only held to its own hard limit.
local pair = tonumber(redis.call('GET', KEYS[1]) or '0')
if pair >= tonumber(ARGV[1]) then
    return {1, math.max(redis.call('PTTL', KEYS[1]), 1)}
end
if tonumber(redis.call('GET', KEYS[2]) or '0') >= tonumber(ARGV[2]) then
    return {2, math.max(redis.call('PTTL', KEYS[2]), 1)}
end
local window = tonumber(ARGV[6])
local failures = tonumber(redis.call('GET', KEYS[3]) or '0')
local soft_start = tonumber(ARGV[3])
if failures >= soft_start and redis.call('EXISTS', KEYS[5]) == 0 then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local lane = 'suspect'
    if pair == 0 then
        lane = 'clean'
    end
    local free_at = tonumber(redis.call('HGET', KEYS[4], lane) or '0')
    if free_at > now then
        return {3, free_at - now}
    end
    local spacing = math.min(tonumber(ARGV[4]) * 2 ^ math.min(failures - soft_start, 30), tonumber(ARGV[5]))
    redis.call('HSET', KEYS[4], lane, now + math.floor(spacing))
    redis.call('PEXPIRE', KEYS[4], window)
end
for i = 1, 3 do
    if redis.call('INCR', KEYS[i]) == 1 then
        redis.call('PEXPIRE', KEYS[i], window)
    end
end
return {0, 0}

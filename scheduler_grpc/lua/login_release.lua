-- KEYS[1]=failed logins for this username from this address (STRING counter)
-- KEYS[2]=failed logins from this address (STRING counter)
-- KEYS[3]=failed logins for this username (STRING counter)
-- KEYS[4]=the marker of this address being known for this username (STRING)
-- ARGV[1]='1' if the password was right, '0' if none was judged   ARGV[2]=how long (ms) a known address stays known
-- Returns 1. Undoes one reservation of login_reserve.lua (the attempt was not a failure: the right
-- password, or a store error before any password was checked), and on the right password
-- (ARGV[1] == '1') forgets this address's failures for this username (it proved it knows the
-- password) and marks the address known for this username (exempt from the soft spacing).
-- Never creates a counter or takes one below zero (one may have expired meanwhile).
for i = 1, 3 do
    if tonumber(redis.call('GET', KEYS[i]) or '0') > 0 then
        redis.call('DECR', KEYS[i])
    end
end
if ARGV[1] == '1' then
    redis.call('DEL', KEYS[1])
    redis.call('SET', KEYS[4], '1', 'PX', ARGV[2])
end
return 1

-- KEYS[1]=the leader lock (LeaderKeys.lock): a STRING holding the current leader's lease id
-- ARGV[1]=the caller's lease id
-- ARGV[2]=the new time to live of the lock, in milliseconds
-- Returns 1 if the lock held ARGV[1] and now expires ARGV[2] ms from now; 0 if the key is gone or
-- holds another lease id (nothing is changed: the caller is no longer the leader and must step down).
--
-- Compare-and-pexpire in one script, so a lock that expired and was taken by another holder is
-- never extended by its former owner.
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0

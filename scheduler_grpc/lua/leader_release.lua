-- KEYS[1]=the leader lock (LeaderKeys.lock): a STRING holding the current leader's lease id
-- ARGV[1]=the caller's lease id
-- ARGV[2]=the release channel (LeaderKeys.released); a pub/sub channel, not a key, hence in ARGV
-- Returns 1 if the lock held ARGV[1] and was deleted, and ARGV[1] was published on ARGV[2];
-- 0 if the key is gone or holds another lease id (nothing is deleted or published).
--
-- Compare-and-delete in one script, so a holder can never delete a lock that is no longer its
-- own. The PUBLISH wakes standbys at once: a graceful handover does not wait for the TTL.
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    redis.call('PUBLISH', ARGV[2], ARGV[1])
    return 1
end
return 0

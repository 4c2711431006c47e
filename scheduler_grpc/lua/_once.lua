-- KEYS[#KEYS]=request (this call's reply, remembered) ARGV[#ARGV]=how long to remember it, in ms
-- Returns: what the wrapped script returns, or, for a call resent with the same request key within
-- that time, what its first run returned, without running it again.
-- The resend guard (see scheduler_grpc/resend.py) wrapped around a script whose body replaces the
-- '-- @body' line. The client's auto-retry resends a call whose reply was lost on a dropped
-- connection; the script then ran already. Empty replies are not remembered: running such a call
-- again changes nothing that the first run did.
local request_key = table.remove(KEYS)
local remember_ms = table.remove(ARGV)
local seen = redis.call('GET', request_key)
if seen then
  return cjson.decode(seen)
end
local reply = (function()
-- @body
end)()
if type(reply) ~= 'table' or next(reply) ~= nil then
  redis.call('SET', request_key, cjson.encode(reply), 'PX', remember_ms)
end
return reply

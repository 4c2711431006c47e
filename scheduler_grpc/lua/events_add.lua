-- KEYS[1]=stream
-- ARGV[1]=approximate cap on the stream's length ARGV[2..]=one encoded event each (JSON)
-- Returns: the stream id of each event, in order. One call appends a whole batch: the client
-- encodes one argument per event instead of one command per event.
local stream_key = KEYS[1]
local ids = {}
for i = 2, #ARGV do
  ids[#ids + 1] = redis.call('XADD', stream_key, 'MAXLEN', '~', ARGV[1], '*', 'e', ARGV[i])
end
return ids

-- Append to a bounded list and (re)set its TTL together, so the list never exists without one.
-- KEYS[1] list key; ARGV[1] element; ARGV[2] TTL in milliseconds; ARGV[3] most elements.
-- Returns the new length, or -1 (and changes nothing) when the list is full.
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[3]) then
    return -1
end
local length = redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return length

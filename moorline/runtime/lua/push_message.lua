-- Queue an injected message under its seq, at most once, and (re)set the queue's TTL with it,
-- so the hash never exists without one. Pushing a seq that is queued already changes nothing:
-- a push retried after its reply was lost must not queue the message twice.
-- KEYS[1] hash seq -> text; ARGV[1] seq; ARGV[2] text; ARGV[3] TTL in milliseconds;
-- ARGV[4] most entries.
-- Returns the number queued, or -1 (and changes nothing) when the queue is full.
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
    return redis.call('HLEN', KEYS[1])
end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then
    return -1
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return redis.call('HLEN', KEYS[1])

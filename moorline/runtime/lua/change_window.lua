-- Open or close an interactive window. One script for both: a pipeline of changes sent to a
-- node is then either all known to it or all refused with NOSCRIPT and sent again in order, so
-- a close asked for after an open is never applied before it.
-- KEYS[1] window key; ARGV[1] 'open' or 'close'; ARGV[2] run id; ARGV[3] TTL in ms (an open).
-- Returns 1 for an open, and for a close that closed (the run held the window); else 0.
if ARGV[1] == 'open' then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return 1
end
if redis.call('GET', KEYS[1]) == ARGV[2] then
    return redis.call('DEL', KEYS[1])
end
return 0

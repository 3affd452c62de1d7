-- Take one unit of a daily quota unless the limit is reached.
-- KEYS[1] the counter; ARGV[1] the limit; ARGV[2] the counter's TTL in milliseconds.
-- The counter is created with its TTL in the same atomic step as the first increment, so no
-- client dying between two commands can leave it without one (INCR then EXPIRE could).
-- INCR keeps an existing TTL. Returns {1, used} when taken, {0, used} when refused.
redis.call('SET', KEYS[1], 0, 'PX', ARGV[2], 'NX')
local used = tonumber(redis.call('GET', KEYS[1]))
if used >= tonumber(ARGV[1]) then
    return {0, used}
end
return {1, redis.call('INCR', KEYS[1])}

-- Take units of a daily quota without passing the limit.
-- KEYS[1] the counter; ARGV[1] the limit; ARGV[2] the counter's TTL in milliseconds;
-- ARGV[3] the units wanted (1 when absent): as many are taken as the limit leaves, up to it.
-- The counter is created with its TTL in the same atomic step as the first increment, so no
-- client dying between two commands can leave it without one (INCR then EXPIRE could).
-- INCRBY keeps an existing TTL. Returns {units taken, used after}: {0, used} when refused.
redis.call('SET', KEYS[1], 0, 'PX', ARGV[2], 'NX')
local used = tonumber(redis.call('GET', KEYS[1]))
local taken = math.min(tonumber(ARGV[3] or 1), tonumber(ARGV[1]) - used)
if taken <= 0 then
    return {0, used}
end
return {taken, redis.call('INCRBY', KEYS[1], taken)}

-- A waiter's look at its interrupt, in one round trip. When the run was cancelled while the
-- interrupt is pending, the cancel decides it (first writer wins, as in resolve_interrupt).
-- KEYS[1] interrupt hash; KEYS[2] the run's cancel flag.
-- ARGV[1] the cancel decision (canonical JSON); ARGV[2] signal channel; ARGV[3] signal payload.
-- Returns {0} when unknown, {1, decision} when resolved, {2} while pending.
local status = redis.call('HGET', KEYS[1], 'status')
if status == false then
    return {0}
end
if status == 'resolved' then
    return {1, redis.call('HGET', KEYS[1], 'decision')}
end
if redis.call('EXISTS', KEYS[2]) == 1 then
    -- HSET on an existing hash keeps its TTL.
    redis.call('HSET', KEYS[1], 'status', 'resolved', 'decision', ARGV[1])
    redis.call('PUBLISH', ARGV[2], ARGV[3])
    return {1, ARGV[1]}
end
return {2}

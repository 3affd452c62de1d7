-- Record an interrupt's decision and wake its waiters, atomically; the first decision wins.
-- KEYS[1] interrupt hash; ARGV[1] decision (canonical JSON); ARGV[2] signal channel;
-- ARGV[3] signal payload.
-- Returns {1, decision} when recorded now, {2, decision} when the same decision was already
-- recorded, {-1, winning decision} when another decision won, {0, false} when unknown.
local status = redis.call('HGET', KEYS[1], 'status')
if status == false then
    return {0, false}
end
if status == 'resolved' then
    local decision = redis.call('HGET', KEYS[1], 'decision')
    if decision == ARGV[1] then
        return {2, decision}
    end
    return {-1, decision}
end
-- HSET on an existing hash keeps its TTL.
redis.call('HSET', KEYS[1], 'status', 'resolved', 'decision', ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return {1, ARGV[1]}

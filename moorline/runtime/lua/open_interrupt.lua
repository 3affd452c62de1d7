-- Create a pending interrupt, or keep the existing one (a replayed run re-opens it), set its
-- TTL, and index it under its run so that cleanup finds it.
-- KEYS[1] interrupt hash; KEYS[2] the run's interrupt index (set).
-- ARGV[1] interrupt id; ARGV[2] TTL in milliseconds. Returns the interrupt's status.
redis.call('HSETNX', KEYS[1], 'status', 'pending')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
-- The index lives as long as its longest-lived interrupt; PTTL is -1 on a new set.
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return redis.call('HGET', KEYS[1], 'status')

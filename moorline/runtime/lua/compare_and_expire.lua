-- Renew a key's TTL only while it still holds the caller's value.
-- KEYS[1] key; ARGV[1] expected value; ARGV[2] TTL in milliseconds.
-- Returns 1 when renewed, 0 when the key expired or belongs to someone else.
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0

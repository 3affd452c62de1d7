-- Take a lease unless someone else holds it; answer who holds it afterwards.
-- SET NX followed by GET would race with an expiry or another taker between the two.
-- KEYS[1] lease key; ARGV[1] holder; ARGV[2] TTL in milliseconds.
-- Returns {1, holder} when the caller holds the lease now, else {0, current holder}.
local current = redis.call('GET', KEYS[1])
if current == false then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    return {1, ARGV[1]}
end
if current == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, current}
end
return {0, current}

-- Add a model call's spend to a tenant's day.
-- KEYS[1] the day's hash; ARGV[1] tokens, ARGV[2] cost in micro-units, ARGV[3] the TTL in ms.
-- The expiry is set in the same atomic step as the increments, so no hash is ever left
-- without one (HINCRBY then a separate PEXPIRE could). Returns {tokens, cost_micros} after.
local tokens = redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[1])
local cost = redis.call('HINCRBY', KEYS[1], 'cost_micros', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {tokens, cost}

-- Give back one unit of a daily quota. KEYS[1] the counter.
-- Only an existing counter above 0 is decremented: DECR on a missing key would create one
-- without a TTL. DECR keeps the TTL. Returns the usage after the call.
local used = tonumber(redis.call('GET', KEYS[1]))
if used == nil then
    return 0
end
if used > 0 then
    return redis.call('DECR', KEYS[1])
end
return used

-- Give back units of a daily quota. KEYS[1] the counter; ARGV[1] the units (1 when absent).
-- Only an existing counter above 0 is decremented, never below 0: DECRBY on a missing key
-- would create one without a TTL. DECRBY keeps the TTL. Returns the usage after the call.
local used = tonumber(redis.call('GET', KEYS[1]))
if used == nil then
    return 0
end
local units = math.min(tonumber(ARGV[1] or 1), used)
if units > 0 then
    return redis.call('DECRBY', KEYS[1], units)
end
return used

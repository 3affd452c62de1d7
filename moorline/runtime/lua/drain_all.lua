-- Take every entry of a hash at once: HGETALL and DEL with nothing in between.
-- KEYS[1] hash key. Returns field, value, field, value, ... (the caller orders them).
local items = redis.call('HGETALL', KEYS[1])
if #items > 0 then
    redis.call('DEL', KEYS[1])
end
return items

-- Take every element of a list at once: LRANGE and DEL with nothing in between.
-- KEYS[1] list key. Returns the elements, head first.
local items = redis.call('LRANGE', KEYS[1], 0, -1)
if #items > 0 then
    redis.call('DEL', KEYS[1])
end
return items

-- Open (or extend) an interactive window: a plain SET with a TTL, as a script so that opens
-- and closes (compare_and_delete) go in one pipeline of scripts, in the order they were asked.
-- KEYS[1] window key; ARGV[1] run id; ARGV[2] TTL in ms. Returns 1.
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1

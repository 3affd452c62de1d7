-- Set a run's cancel flag (with its TTL) and wake the run's waiters; the flag is written
-- before the signal, so a waiter that re-checks after the signal always sees it.
-- KEYS[1] cancel flag; ARGV[1] TTL in milliseconds; ARGV[2] signal channel; ARGV[3] payload.
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1

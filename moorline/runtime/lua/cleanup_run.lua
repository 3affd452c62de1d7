-- Delete a run's keys and wake its waiters, in one step. A script rather than MULTI/EXEC: a
-- Redis Cluster transaction may hold only commands of one slot, and PUBLISH names no key.
-- KEYS every key of the run (one hash tag, so one slot); ARGV[1] signal channel; ARGV[2] payload.
redis.call('DEL', unpack(KEYS))
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1

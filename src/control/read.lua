-- The operators' entries, when they changed (control/sync.rs).
-- KEYS[1]: the version counter; KEYS[2]: the bans hash; KEYS[3]: the overrides hash (all three
-- share one hash tag, so one slot on a Redis Cluster).
-- ARGV[1]: the version the caller holds ("" for none).
-- Returns {version} when it is the caller's, else {version, bans, overrides}, each hash as
-- HGETALL gives it (ID, JSON record, ID, JSON record, ...). A missing counter is version "0".
local v = redis.call('GET', KEYS[1]) or '0'
if v == ARGV[1] then
  return {v}
end
return {v, redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3])}

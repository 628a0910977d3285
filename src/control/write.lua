-- One change to the operators' entries (control/sync.rs), and the version counter with it.
-- KEYS[1]: the version counter; KEYS[2]: the hash of bans or of overrides (one hash tag).
-- ARGV[1]: "put" or "del"; ARGV[2]: the entry's ID; ARGV[3]: its JSON record ("put" only).
-- Returns 1 when the hash changed (and the counter went up), 0 when there was nothing to
-- delete: of replicas deleting one expired entry at once, one sees 1.
if ARGV[1] == 'put' then
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
elseif redis.call('HDEL', KEYS[2], ARGV[2]) == 0 then
  return 0
end
redis.call('INCR', KEYS[1])
return 1

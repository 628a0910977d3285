-- Concurrency leases: KEYS[1] is a sorted set of one limit and identity, its members lease IDs
-- scored by their expiry in milliseconds on Redis's clock.
--   take  max lease_ms id   -> {1, in flight with it} or {0, in flight}
--   renew lease_ms id...    -> how many were still held (XX: a released lease stays released)
--   drop  id                -> 0
local key = KEYS[1]
local mode = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if mode == 'take' then
  local lease = tonumber(ARGV[3])
  -- Leases a replica stopped renewing (it crashed, or lost Redis) are free again.
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local n = redis.call('ZCARD', key)
  if n >= tonumber(ARGV[2]) then
    return {0, n}
  end
  redis.call('ZADD', key, now + lease, ARGV[4])
  -- Every member expires by now + lease: the set may go with its last lease.
  redis.call('PEXPIRE', key, lease)
  return {1, n + 1}
elseif mode == 'renew' then
  local lease = tonumber(ARGV[2])
  local held = 0
  for i = 3, #ARGV do
    held = held + redis.call('ZADD', key, 'XX', 'CH', now + lease, ARGV[i])
  end
  if redis.call('EXISTS', key) == 1 then
    redis.call('PEXPIRE', key, lease)
  end
  return held
elseif mode == 'drop' then
  redis.call('ZREM', key, ARGV[2])
  return 0
end
return redis.error_reply('lease.lua: unknown mode ' .. tostring(mode))

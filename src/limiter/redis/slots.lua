-- Concurrency leases: each key is a sorted set of one limit and identity, its members lease IDs
-- scored by their expiry in milliseconds on Redis's clock.
--   batch op...             -> two integers per take, in order: {1, in flight with it} or
--                              {0, in flight}; an op is one of
--                                t KEY_INDEX max lease_ms id   (take a slot)
--                                d KEY_INDEX id                (release one)
--   renew lease_ms id...    -> how many were still held (XX: a released lease stays released);
--                              KEYS[1] the set
local mode = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Within one batch a set is swept and counted once, and its expiry set once at the end.
local count = {}
local expire = {}

local function card(key)
  local n = count[key]
  if n == nil then
    -- Leases a replica stopped renewing (it crashed, or lost Redis) are free again.
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    n = redis.call('ZCARD', key)
  end
  return n
end

local function take(key, max, lease, id)
  local n = card(key)
  if n >= max then
    count[key] = n
    return 0, n
  end
  redis.call('ZADD', key, now + lease, id)
  count[key] = n + 1
  -- Every member expires by now + lease: the set may go with its last lease.
  expire[key] = math.max(expire[key] or 0, lease)
  return 1, n + 1
end

if mode == 'batch' then
  local out = {}
  local i = 2
  while i <= #ARGV do
    local key = KEYS[tonumber(ARGV[i + 1])]
    if ARGV[i] == 't' then
      local added, n = take(key, tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), ARGV[i + 4])
      out[#out + 1] = added
      out[#out + 1] = n
      i = i + 5
    elseif ARGV[i] == 'd' then
      local removed = redis.call('ZREM', key, ARGV[i + 2])
      if count[key] ~= nil then
        count[key] = count[key] - removed
      end
      i = i + 3
    else
      return redis.error_reply('slots.lua: unknown op ' .. tostring(ARGV[i]))
    end
  end
  for key, lease in pairs(expire) do
    redis.call('PEXPIRE', key, lease)
  end
  return out
elseif mode == 'renew' then
  local key = KEYS[1]
  local lease = tonumber(ARGV[2])
  local held = 0
  for i = 3, #ARGV do
    held = held + redis.call('ZADD', key, 'XX', 'CH', now + lease, ARGV[i])
  end
  if redis.call('EXISTS', key) == 1 then
    redis.call('PEXPIRE', key, lease)
  end
  return held
end
return redis.error_reply('slots.lua: unknown mode ' .. tostring(mode))

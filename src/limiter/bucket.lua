-- tollgate: check N token buckets (GCRA) as one atomic step, on Redis's own clock.
--
-- The arithmetic is exactly `limiter::step` (src/limiter/mod.rs); keep the two in step.
-- A bucket is one string key holding its `tat` (theoretical arrival time, on the Redis clock, in
-- microseconds since EPOCH below, formatted with %.17g so it round-trips exactly). A missing
-- key is a full bucket, and a key expires at its `tat`, when the bucket is full again.
--
-- KEYS[i]   the key of bucket i. In Redis Cluster all keys of one call share a slot.
-- ARGV[1]   mode:
--             "check"  charge every admitting bucket, but only when every enforced bucket
--                      admits; a rejected request writes nothing anywhere.
--             "peek"   compute the verdicts, write nothing.
--             "refund" give back `cost` tokens to every bucket (undo an earlier "check"
--                      whose request another slot rejected); `tat` never goes below now.
-- ARGV[2 + 4*(i-1) ..]  per bucket i, four values:
--             token_us  microseconds per token (1e6 / rate)
--             tau_us    burst * token_us
--             cost      tokens this request takes
--             enforced  1, or 0 for a shadow bucket (its rejection blocks nothing)
--
-- Returns, for "check" and "peek", a flat array:
--   [1]  1 if every enforced bucket admits, else 0
--   then per bucket i, four values:
--        admitted (integer 0/1), remaining whole tokens (integer),
--        reset_us (string, %.17g: microseconds until the bucket is full),
--        retry_after_us (string, %.17g: microseconds until `cost` tokens exist; 0 if admitted)
--   Floats go back as strings on purpose: Redis truncates Lua numbers to integers.
-- For "refund", the number of buckets that held a `tat`.

-- Scripts that read TIME and then write must be replicated by effect (the default since
-- Redis 5; older servers need to be asked, and Redis 7 still accepts the call).
if redis.replicate_commands then
  redis.replicate_commands()
end

-- Microseconds since 1970 (1.8e15) are doubles with a 0.25 us step, coarse enough to eat the
-- 1e-6 tolerance of the admit test; counting from 2023-11-14 keeps `tat` some 20 times finer
-- for decades. Part of the stored format: changing it invalidates every bucket.
local EPOCH = 1700000000
local time = redis.call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000000 + tonumber(time[2])
local mode = ARGV[1]

local function bucket_args(i)
  local a = 2 + 4 * (i - 1)
  return tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3] == '1'
end

-- Store `tat` and let the key vanish when the bucket is full again (at least 1 ms later).
local function store(key, tat)
  local ttl_ms = math.max(1, math.ceil((tat - now) / 1000))
  redis.call('SET', key, string.format('%.17g', tat), 'PX', ttl_ms)
end

if mode == 'refund' then
  local refunded = 0
  for i = 1, #KEYS do
    local tok, _, cost = bucket_args(i)
    local tat = tonumber(redis.call('GET', KEYS[i]))
    if tat then
      refunded = refunded + 1
      local back = tat - cost * tok
      if back > now then
        store(KEYS[i], back)
      else
        redis.call('DEL', KEYS[i])
      end
    end
  end
  return refunded
end

local out = { 1 }
local new_tats = {}
local all_admit = true
for i = 1, #KEYS do
  local tok, tau, cost, enforced = bucket_args(i)
  local tat = tonumber(redis.call('GET', KEYS[i]))
  local base = now
  if tat and tat > now then
    base = tat
  end
  local new_tat = base + cost * tok
  local admitted, reset, retry
  if new_tat - now <= tau + 1e-6 then
    admitted, reset, retry = 1, new_tat - now, 0
    new_tats[i] = new_tat
  else
    admitted, reset, retry = 0, base - now, new_tat - now - tau
    if enforced then
      all_admit = false
    end
  end
  -- Whole tokens left, tolerant of the float error of an exact multiple (as `whole_tokens`).
  local remaining = math.floor((tau - reset) / tok + 1e-9)
  if remaining < 0 then
    remaining = 0
  end
  local o = 2 + 4 * (i - 1)
  out[o] = admitted
  out[o + 1] = remaining
  out[o + 2] = string.format('%.17g', reset)
  out[o + 3] = string.format('%.17g', retry)
end

if not all_admit then
  out[1] = 0
elseif mode == 'check' then
  for i = 1, #KEYS do
    if new_tats[i] then
      store(KEYS[i], new_tats[i])
    end
  end
end
return out

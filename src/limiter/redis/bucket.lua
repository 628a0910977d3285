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
--                      admits; a rejected request writes nothing anywhere (except the clamp
--                      below: a bucket whose `tat` Redis's clock left too far ahead).
--             "refund" give back `cost` tokens to every bucket (undo an earlier "check"
--                      whose request another slot rejected); `tat` never goes below now.
--             "charge" take `cost` more tokens from every (token) bucket, whatever it holds:
--                      a settled cost's difference, which may leave the bucket owing.
--             "batch"  several independent "check"s in one call (requests that were waiting
--                      at the same moment), sent as groups of identical checks (the same
--                      buckets with the same values: one hot client, or a limit every client
--                      shares): ARGV[2] is the number of groups, then per group the number m
--                      of checks in it, its number of buckets n, then its buckets' five values
--                      each. A group takes n KEYS, in order; its m checks run one after the
--                      other, as m "check" calls would, and the groups run in order. A group
--                      of m = 0 is a settlement of its one token bucket (n = 1), as "charge"
--                      does, and of m = -1 a refund of it, as "refund" does; it has no reply.
-- ARGV[2 + 5*(i-1) ..]  per bucket i, five values:
--             token_us  microseconds per token (1e6 / rate); for a quota, its count N
--             tau_us    burst * token_us (unused for a quota)
--             cost      tokens this request takes
--             enforced  1, or 0 for a shadow bucket (its rejection blocks nothing)
--             window    "-" for a token bucket with no ban; else space-separated parts:
--                       "q s0 s1 s2 s3" for a calendar quota, the window bounds (microseconds
--                       since EPOCH) the proxy computed for its own now: the windows
--                       [s0, s1), [s1, s2) and [s2, s3). The one holding Redis's `now` is
--                       counted in (so replicas agree at a boundary whatever their clocks say,
--                       within a window), [s1, s2) if none does; "s L" for a sliding window
--                       and "x L" for an exact one, of L microseconds (windows aligned to the
--                       UNIX epoch, found by Redis's clock). "l N" for a token bucket whose
--                       check also takes a lease: once the check admits and charges, up to N
--                       more tokens, as many as the bucket holds after `cost` (the reply's
--                       `remaining`, which counts them: the caller holds min(N, remaining)).
--                       Then "b after within for max" (microseconds) for a limit with a ban
--                       (see "Bans" below). "d" first for a token bucket that may owe
--                       tokens (a settled cost): its `tat` past now + tau is a debt to wait
--                       out, never clamped.
--
-- A quota bucket in its window [s, e) of N, with tok = (e - s) / N, holds the same one number:
-- `tat` = s + used * tok. used = clamp(floor((tat - s) / tok + 0.5), 0, N) (a `tat` of an
-- earlier window is at most s: 0); it admits when used + cost <= N, and is then written as
-- s + (used + cost) * tok, expiring at e; reset and retry are e - now. `limiter::quota::step`
-- is the same arithmetic.
--
-- A sliding window of N and length L keeps two quota counters, `<key>:0` and `<key>:1`, for
-- the even and odd windows since the UNIX epoch: this window's count `cur` and the last one's
-- `last`, each read from its `tat` as a quota's. It admits when
-- cur + last * (1 - (now - s) / L) + cost <= N, writes this window's counter, expiring at
-- s + 2L, and answers the retry time at which that estimate first leaves room (later in this
-- window, or in the next one where `cur` slides out). `limiter::quota::slide` is the same.
-- An exact window keeps a sorted set `<key>:x` of the times (scores, on this clock) of the
-- requests in the last L: entries at or below now - L are removed, and a request is admitted
-- when ZCARD + cost <= N (members "now:n", n the count after it, unique); the set expires L
-- after its newest entry. The retry time is when the oldest entry that must go leaves the
-- window. `limiter::quota::exact` is the same. A refund takes the newest `cost` entries back.
-- When Redis's clock steps back, entries after now count as now, and window counters of a
-- later window as spent windows ending on this clock: nothing stays refused, or kept, for
-- longer than the window's length (as a bucket is clamped to empty-from-now).
--
-- Bans. A bucket with a ban has a hash `<key>:ban` (the same hash tag, so the same slot):
-- u (banned until), l (bans so far), lu (l is forgotten then), s (strikes), su (the strikes'
-- window ends). `limiter::ban` is the same arithmetic: while u > now the bucket refuses
-- without a step (reply code 1; no strike anywhere in the check); once this limit rejects
-- `after` times within `within` (from the first strike), the identity is banned for
-- min(for * 2^l, max) if lu > now (else for), l += 1, lu = u + max (code 3, the retry being
-- the ban). The first check after a ban ends says so (code 2). The hash expires when u, lu and
-- su are all past.
--
-- Returns, for "check", one string: per bucket i, four big-endian doubles (32 bytes),
--        remaining whole tokens,
--        reset_us (microseconds until the bucket is full, rounded up),
--        retry_after_us (microseconds until `cost` tokens exist, rounded up; 0 if and only if
--        the bucket admits: a rejection is always at least 1),
--        the ban code (0 none, 1 refused by a ban, 2 a ban seen lifted, 3 a ban begun).
--        One packed string rather than an array of integers: the client parses a batch's
--        reply of hundreds of numbers as one bulk string, which costs it a small fraction of
--        parsing as many RESP integers, and Redis writes it with one memcpy.
-- The check as a whole admits when every enforced bucket does: the caller, who knows which
-- buckets are enforced, tells from the retry values (so the reply carries no flags).
--
-- Clock steps. `now` is Redis's wall clock, which can step: an NTP correction, or a failover to
-- a replica whose clock is off. Forward, a bucket is full (`max(tat, now)`) and holds `burst`
-- tokens, never more: one bucket is minted, no more. Backward, a `tat` is left further ahead of
-- `now` than the arithmetic ever puts it (`tau`, plus 1 us of float slack): taken as is it
-- would withhold every token for as long as the step (an hour's step, an hour's lockout). Such
-- a `tat` is clamped to `now + tau - token_us` (one token left) and written back, so the
-- bucket refills from now on: the client waits at most `(cost - 1) * token_us` for its next
-- request, and the bucket is full again within one refill period (`tau`), whatever the step.
-- An override that raises a limit (a smaller `tau`) meets the same clamp. `limiter::step`
-- clamps alike (`limiter::clamped`; its own clock is monotonic, so only overrides fire it).
-- For "batch", the replies of its checks, group by group (m replies of 3n values each),
-- concatenated.
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
-- Globals are table lookups in Lua 5.1: the ones used per bucket are made locals.
-- Every `function` statement makes a closure on every call of the script, so the code below
-- defines only one (`check`, for checks of several buckets) and writes the rest out inline
-- (docs/performance.md has what the closures cost).
local tonumber, floor, ceil, max, pack = tonumber, math.floor, math.ceil, math.max, struct.pack
local format, call = string.format, redis.call
local time = call('TIME')
local now = (tonumber(time[1]) - EPOCH) * 1000000 + tonumber(time[2])
local mode = ARGV[1]

-- A bucket is stored (here and in the final loop) as its `tat` in %.17g, which round-trips
-- exactly, with a TTL that makes the key vanish when the bucket is full again (at least 1 ms).
if mode == 'charge' then
  for i = 1, #KEYS do
    local a = 2 + 5 * (i - 1)
    local tok, cost = tonumber(ARGV[a]), tonumber(ARGV[a + 2])
    local tat = tonumber(call('GET', KEYS[i]))
    if not tat or tat < now then
      tat = now
    end
    tat = tat + cost * tok
    call('SET', KEYS[i], format('%.17g', tat), 'PX', max(1, ceil((tat - now) / 1000)))
  end
  return #KEYS
end

if mode == 'refund' then
  local refunded = 0
  for i = 1, #KEYS do
    local a = 2 + 5 * (i - 1)
    local tok, tau, cost = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local tat = tonumber(call('GET', KEYS[i]))
    local w = ARGV[a + 4]
    local kind = string.sub(w, 1, 1)
    if kind == 's' then
      -- A sliding window: give back `cost` of this window's counter.
      local len = tonumber(string.match(w, '^s (%d+)'))
      local abs = now + EPOCH * 1000000
      local s = now - abs % len
      local ckey = KEYS[i] .. ':' .. ((abs - abs % len) / len) % 2
      local ctat = tonumber(call('GET', ckey))
      local qtok = len / tok
      if ctat and ctat > s then
        refunded = refunded + 1
        local back = math.min(floor((ctat - s) / qtok + 0.5), tok) - cost
        if back > 0 then
          call('SET', ckey, format('%.17g', s + back * qtok), 'PX', max(1, ceil((s + 2 * len - now) / 1000)))
        else
          call('DEL', ckey)
        end
      end
      tat = nil
    elseif kind == 'x' then
      -- An exact window: the newest `cost` entries go.
      if #call('ZPOPMAX', KEYS[i] .. ':x', cost) > 0 then
        refunded = refunded + 1
      end
      tat = nil
    elseif kind == 'q' then
      -- A quota: give back `cost` of this window's count.
      local s0, s1, s2, s3 = string.match(w, '^q (-?%d+) (-?%d+) (-?%d+) (-?%d+)')
      s0, s1, s2, s3 = tonumber(s0), tonumber(s1), tonumber(s2), tonumber(s3)
      local s, e = s1, s2
      if now >= s0 and now < s1 then
        s, e = s0, s1
      elseif now >= s2 and now < s3 then
        s, e = s2, s3
      end
      local qtok = (e - s) / tok
      if tat and tat > s then
        refunded = refunded + 1
        local back = math.min(floor((tat - s) / qtok + 0.5), tok) - cost
        if back > 0 then
          call('SET', KEYS[i], format('%.17g', s + back * qtok), 'PX', max(1, ceil((e - now) / 1000)))
        else
          call('DEL', KEYS[i])
        end
      end
      tat = nil
    elseif tat and tat - now > tau + 1 and kind ~= 'd' then
      tat = now + tau
    end
    if tat then
      refunded = refunded + 1
      local back = tat - cost * tok
      if back > now then
        call('SET', KEYS[i], format('%.17g', back), 'PX', max(1, ceil((back - now) / 1000)))
      else
        call('DEL', KEYS[i])
      end
    end
  end
  return refunded
end

-- Buckets are read at most once (all together, here) and written at most once per call,
-- however many checks of a batch touch them (a busy client's requests often share a batch):
-- `tats` holds what this call has read or decided (false: no key), `written` the new `tat` of
-- each bucket to write back at the end (the order of the writes does not matter: each is a
-- key of its own, and the script is atomic).
-- Every key of the call read by MGET: one command inside Redis instead of one GET per bucket.
-- In chunks, as `unpack` is bounded by Lua's C stack (8000 values).
local tats = {}
local written = {}
local CHUNK = 1000
for first = 1, #KEYS, CHUNK do
  local last = math.min(first + CHUNK - 1, #KEYS)
  local values = call('MGET', unpack(KEYS, first, last))
  for i = first, last do
    tats[KEYS[i]] = tonumber(values[i - first + 1]) or false
  end
end

-- The GCRA step of one bucket holding `tat` (false: full; clamped first, as the header says)
-- at `now`, for `cost` tokens: admitted
-- when `new_tat - now <= tau` (with a 1e-6 tolerance); the reply's reset and retry times; and
-- whole tokens left, tolerant of the float error of an exact multiple (as `whole_tokens`). It
-- is written twice below, in `check` and in the loop of a group of one bucket: keep them alike.
local out = {}
-- When a quota's key is to expire (its window's end), by key; token buckets expire at `tat`.
local expires = {}
-- Ban states read (one HMGET of `<key>:ban` per bucket with a ban, at its first check in the
-- call), and those to write back.
local bans = {}
local ban_dirty = {}
-- Exact windows' logs by key: entries held after pruning, and added by this call.
local logs = {}

-- Check the n buckets KEYS[k0 + 1 .. k0 + n], whose values start at ARGV[a] (four each); append
-- the check's reply to `out`; charge the buckets when every enforced one admits.
local function check(k0, a, n)
  local new_tats = {}
  local ends = {}
  -- Leased tokens to take beside the cost, by bucket, once the check charges.
  local leases = {}
  -- The key a sliding window's counter is written to, and the log an exact one adds to.
  local wkeys = {}
  local xadds = {}
  local all_admit = true
  -- Rejections by limits with a ban, counted as strikes once the loop knows no ban refused
  -- the request (a refused request is no strike anywhere).
  local strikes = {}
  local refused = false
  for i = 1, n do
    local b = a + 5 * (i - 1)
    local tok, tau, cost = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
    local key = KEYS[k0 + i]
    local tat = tats[key]
    local w = ARGV[b + 4]
    local enforced = ARGV[b + 3] == '1'
    local remaining, reset, retry, code = 0, 0, 0, 0
    local ban, after, within, first, bmax
    if w ~= '-' then
      after, within, first, bmax = string.match(w, 'b (%d+) (%d+) (%d+) (%d+)$')
      if after then
        ban = bans[key]
        if not ban then
          local v = call('HMGET', key .. ':ban', 'u', 'l', 'lu', 's', 'su')
          ban = {
            u = tonumber(v[1]) or 0, l = tonumber(v[2]) or 0, lu = tonumber(v[3]) or 0,
            s = tonumber(v[4]) or 0, su = tonumber(v[5]) or 0,
          }
          bans[key] = ban
        end
      end
    end
    if ban and ban.u > now then
      -- Banned: refused without a step.
      refused, code = true, 1
      reset, retry = ban.u - now, ban.u - now
      if enforced then
        all_admit = false
      end
    else
      if ban and ban.u > 0 then
        -- The ban is over: this request is the first since.
        ban.u, code = 0, 2
        ban_dirty[key] = true
      end
      local s0, s1, s2, s3, sl, xl
      if w ~= '-' then
        s0, s1, s2, s3 = string.match(w, '^q (-?%d+) (-?%d+) (-?%d+) (-?%d+)')
        sl = string.match(w, '^s (%d+)')
        xl = string.match(w, '^x (%d+)')
      end
      if sl then
        -- A sliding window (see the header); `tok` carries its count.
        local len = tonumber(sl)
        local abs = now + EPOCH * 1000000
        local s = now - abs % len
        local j = ((abs - abs % len) / len) % 2
        local ckey, pkey = key .. ':' .. j, key .. ':' .. (1 - j)
        if tats[ckey] == nil or tats[pkey] == nil then
          local v = call('MGET', ckey, pkey)
          if tats[ckey] == nil then
            tats[ckey] = tonumber(v[1]) or false
          end
          if tats[pkey] == nil then
            tats[pkey] = tonumber(v[2]) or false
          end
        end
        -- Counters of a later window: Redis's clock stepped back. Clamped to spent windows
        -- that end on this clock, as a stepped-back bucket is clamped to empty-from-now, so
        -- nothing stays spent (or kept) for longer than the window allows.
        if tats[ckey] and tats[ckey] > s + len then
          tats[ckey], written[ckey], expires[ckey] = s + len, s + len, s + 2 * len
        end
        if tats[pkey] and tats[pkey] > s then
          tats[pkey], written[pkey], expires[pkey] = s, s, s + len
        end
        local qtok = len / tok
        local cur, last = 0, 0
        if tats[ckey] then
          cur = math.min(max(floor((tats[ckey] - s) / qtok + 0.5), 0), tok)
        end
        if tats[pkey] then
          last = math.min(max(floor((tats[pkey] - s + len) / qtok + 0.5), 0), tok)
        end
        local est = cur + last * (1 - (now - s) / len)
        local admit = est + cost <= tok + 1e-9
        -- Full again once both counts (this window's with this request, if admitted) slid out.
        reset = 1
        if cur > 0 or (admit and cost > 0) then
          reset = s + 2 * len - now
        elseif last > 0 then
          reset = s + len - now
        end
        if admit then
          remaining = floor(tok - est - cost + 1e-9)
          new_tats[i], ends[i], wkeys[i] = s + (cur + cost) * qtok, s + 2 * len, ckey
        else
          remaining = max(floor(tok - est + 1e-9), 0)
          local at
          if cur + cost <= tok then
            at = s + (1 - (tok - cur - cost) / last) * len
          elseif cost <= tok then
            at = s + len + max(1 - (tok - cost) / cur, 0) * len
          else
            at = s + 2 * len
          end
          retry = max(at - now, 1)
        end
      elseif xl then
        -- An exact window (see the header); `tok` carries its count.
        local len = tonumber(xl)
        local lkey = key .. ':x'
        local log = logs[lkey]
        if not log then
          call('ZREMRANGEBYSCORE', lkey, '-inf', format('%.17g', now - len))
          -- Times after now: Redis's clock stepped back. Counted as now, so that they leave
          -- within one window, as a stepped-back bucket is clamped to empty-from-now.
          local ahead = call('ZRANGEBYSCORE', lkey, format('(%.17g', now), '+inf')
          for _, m in ipairs(ahead) do
            call('ZADD', lkey, format('%.17g', now), m)
          end
          log = { held = call('ZCARD', lkey), added = 0 }
          logs[lkey] = log
        end
        local held = log.held + log.added
        if held + cost <= tok then
          remaining, reset, xadds[i] = tok - held - cost, len, lkey
        else
          remaining = max(tok - held, 0)
          -- The k-th oldest entry must leave first.
          local k = held + cost - tok
          local at = now + len
          if cost <= tok and k <= log.held then
            at = tonumber(call('ZRANGE', lkey, k - 1, k - 1, 'WITHSCORES')[2]) + len
          end
          retry = max(at - now, 1)
          reset = len
          if log.added == 0 then
            local newest = call('ZRANGE', lkey, -1, -1, 'WITHSCORES')[2]
            reset = max((tonumber(newest) or now) + len - now, 1)
          end
        end
      elseif s0 then
        -- A calendar quota (see the header); `tok` carries its count.
        s0, s1, s2, s3 = tonumber(s0), tonumber(s1), tonumber(s2), tonumber(s3)
        local s, e = s1, s2
        if now >= s0 and now < s1 then
          s, e = s0, s1
        elseif now >= s2 and now < s3 then
          s, e = s2, s3
        end
        if tat and tat > e then
          -- Counted in a later window: Redis's clock stepped back (see the sliding case).
          tat = e
          tats[key], written[key], expires[key] = tat, tat, e
        end
        local qtok = (e - s) / tok
        local used = 0
        if tat then
          used = floor((tat - s) / qtok + 0.5)
          if used < 0 then
            used = 0
          elseif used > tok then
            used = tok
          end
        end
        reset = e - now
        if reset < 1 then
          reset = 1
        end
        remaining = tok - used - cost
        if used + cost <= tok then
          -- Redis's clock outside every window the proxy passed (a skew of more than a
          -- window): counted in the proxy's window, kept one window's length from now, not
          -- expired at once (which would admit every request).
          local keep = e
          if now < s0 or now >= s3 then
            keep = now + (e - s)
          end
          new_tats[i], ends[i] = s + (used + cost) * qtok, keep
        else
          retry, remaining = reset, tok - used
        end
      else
        if tat and tat - now > tau + 1 and string.sub(w, 1, 1) ~= 'd' then
          -- Redis's clock stepped back, or an override raised the rate (see the header): a
          -- bucket with one token left from now on (`limiter::clamped`).
          tat = now + max(tau - tok, 0)
          tats[key], written[key] = tat, tat
        end
        local base = now
        if tat and tat > now then
          base = tat
        end
        local new_tat = base + cost * tok
        reset = new_tat - now
        if new_tat - now <= tau + 1e-6 then
          new_tats[i] = new_tat
        else
          reset, retry = base - now, new_tat - now - tau
        end
        remaining = floor((tau - reset) / tok + 1e-9)
        if remaining < 0 then
          remaining = 0
        end
        local lease = w ~= '-' and tonumber(string.match(w, '^l (%d+)'))
        if lease and new_tats[i] then
          leases[i] = math.min(lease, remaining) * tok
        end
      end
      if retry > 0 then
        if enforced then
          all_admit = false
        end
        if ban then
          strikes[#strikes + 1] = {
            key = key, ban = ban, o = #out + 1, remaining = remaining, reset = reset,
            after = tonumber(after), within = tonumber(within), first = tonumber(first),
            bmax = tonumber(bmax),
          }
        end
      end
    end
    out[#out + 1] = pack('>dddd', remaining, ceil(reset), ceil(retry), code)
  end
  if not refused then
    for _, st in ipairs(strikes) do
      -- One strike (`limiter::ban`): the window opens at the first; the last one bans.
      local ban = st.ban
      if ban.su <= now then
        ban.s, ban.su = 0, now + st.within
      end
      ban.s = ban.s + 1
      if ban.s >= st.after then
        local level = 0
        if ban.lu > now then
          level = ban.l
        end
        local length = st.first * 2 ^ level
        if length > st.bmax then
          length = st.bmax
        end
        ban.u, ban.l, ban.lu, ban.s, ban.su = now + length, level + 1, now + length + st.bmax, 0, 0
        out[st.o] = pack('>dddd', st.remaining, ceil(max(st.reset, length)), ceil(length), 3)
      end
      ban_dirty[st.key] = true
    end
  end
  if all_admit then
    for i = 1, n do
      local lkey = xadds[i]
      if lkey then
        local log = logs[lkey]
        local cost = tonumber(ARGV[a + 5 * (i - 1) + 2])
        for c = 1, cost do
          call('ZADD', lkey, now, format('%.0f:%d', now, log.held + log.added + c))
        end
        log.added = log.added + cost
        call('PEXPIRE', lkey, max(1, ceil(tonumber(string.match(ARGV[a + 5 * (i - 1) + 4], '^x (%d+)')) / 1000)))
      end
      local tat = new_tats[i]
      if tat then
        tat = tat + (leases[i] or 0)
        local key = wkeys[i] or KEYS[k0 + i]
        tats[key], written[key] = tat, tat
        if ends[i] then
          expires[key] = ends[i]
        end
      end
    end
  end
end

if mode == 'batch' then
  local k0, a = 0, 3
  for _ = 1, tonumber(ARGV[2]) do
    local m, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
    if m <= 0 then
      -- A settled cost's difference, after the checks before it in this call: charged whatever
      -- the bucket holds (it may owe), or refunded down to a full bucket at most.
      local key = KEYS[k0 + 1]
      local tok, cost = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 4])
      local tat = tats[key]
      if not tat or tat < now then
        tat = now
      end
      if m == 0 then
        tat = tat + cost * tok
      else
        tat = max(tat - cost * tok, now)
      end
      tats[key], written[key] = tat, tat
    elseif n == 1 and ARGV[a + 6] == '-' then
      -- A group of m checks of one bucket each (a route with one limit, the common case): the
      -- steps of `check`, with the bucket kept in a local from one check to the next. This loop
      -- is where a hot key's checks go.
      local key = KEYS[k0 + 1]
      local tok, tau, cost = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
      local tat = tats[key]
      if tat and tat - now > tau + 1 then
        tat = now + max(tau - tok, 0)
        tats[key], written[key] = tat, tat
      end
      local charged = false
      local o = #out
      for _ = 1, m do
        local base = now
        if tat and tat > now then
          base = tat
        end
        local new_tat = base + cost * tok
        local reset, retry = new_tat - now, 0
        if new_tat - now <= tau + 1e-6 then
          tat, charged = new_tat, true
        else
          reset, retry = base - now, new_tat - now - tau
        end
        local remaining = floor((tau - reset) / tok + 1e-9)
        if remaining < 0 then
          remaining = 0
        end
        o = o + 1
        out[o] = pack('>dddd', remaining, ceil(reset), ceil(retry), 0)
      end
      if charged then
        tats[key], written[key] = tat, tat
      end
    else
      -- Several buckets: each of the m checks is a "check" of its own.
      for _ = 1, m do
        check(k0, a + 2, n)
      end
    end
    k0 = k0 + n
    a = a + 2 + 5 * n
  end
else
  check(0, 2, #KEYS)
end
for key, tat in pairs(written) do
  local until_us = expires[key] or tat
  call('SET', key, format('%.17g', tat), 'PX', max(1, ceil((until_us - now) / 1000)))
end
for key in pairs(ban_dirty) do
  local ban = bans[key]
  -- Kept while the ban, its level or its strikes' window lasts.
  local keep = max(ban.u, ban.lu, ban.su) - now
  if keep > 0 then
    call('HSET', key .. ':ban', 'u', format('%.17g', ban.u), 'l', ban.l,
      'lu', format('%.17g', ban.lu), 's', ban.s, 'su', format('%.17g', ban.su))
    call('PEXPIRE', key .. ':ban', max(1, ceil(keep / 1000)))
  else
    call('DEL', key .. ':ban')
  end
end
return table.concat(out)

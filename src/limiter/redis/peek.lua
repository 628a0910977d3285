-- tollgate explain: one identity's state under one limit, read in one atomic step, writing
-- nothing (so it takes no token, counts no strike and holds no slot).
--
-- KEYS[1]  the bucket key  `<key_prefix><limit>:{<client hex>}` (its `tat`, see bucket.lua)
-- KEYS[2]  its ban hash    `<bucket key>:ban` (u, l, lu, s, su, see bucket.lua "Bans")
-- KEYS[3]  its lease set   `<key_prefix><limit>:c:{<client hex>}` (see slots.lua)
-- All three share the hash tag, so one slot on a Redis Cluster.
--
-- Returns {TIME seconds, TIME microseconds, tat or nil, u, l, lu, s, su (each or nil),
--          leases live now, a sliding window's even and odd counters (each or nil), an exact
--          window's log as {member, score, ...}}.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ban = redis.call('HMGET', KEYS[2], 'u', 'l', 'lu', 's', 'su')
return {
  t[1], t[2], redis.call('GET', KEYS[1]),
  ban[1], ban[2], ban[3], ban[4], ban[5],
  redis.call('ZCOUNT', KEYS[3], '(' .. now_ms, '+inf'),
  redis.call('GET', KEYS[1] .. ':0') or false, redis.call('GET', KEYS[1] .. ':1') or false,
  redis.call('ZRANGE', KEYS[1] .. ':x', 0, -1, 'WITHSCORES'),
}

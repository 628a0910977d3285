-- wrk script: every request carries one of KEYS distinct X-API-Key values (default 100000),
-- cycled in order. The requests are formatted once in init(), so the per-request Lua cost is a
-- table lookup. Each wrk thread starts at its own offset, so the threads do not send the same
-- key at the same moment.
local n = tonumber(os.getenv("KEYS") or "100000")
local next_id = 0

function setup(thread)
   thread:set("id", next_id)
   next_id = next_id + 1
end

local reqs = {}
local i = 0

function init(args)
   for k = 1, n do
      reqs[k] = wrk.format(nil, nil, { ["X-API-Key"] = "bench-key-" .. k })
   end
   i = ((id or 0) * math.floor(n / 2)) % n
end

function request()
   i = i % n + 1
   return reqs[i]
end

-- ARGV: ns, older_than_ms, ''. Returns the nodes whose liveness mark ended older_than_ms ago or
-- more (the deadline each heartbeat writes to <ns>:dl; a dead node without one starts its clock
-- now).
local older = tonumber(ARGV[2])
local now = now_ms()
local out = {}
local members = redis.call('SMEMBERS', ns .. ':nodes')
for i = 1, #members do
  local n = members[i]
  if redis.call('EXISTS', ns .. ':live:' .. n) == 0 then
    local dl = redis.call('HGET', ns .. ':dl', n)
    if not dl then redis.call('HSET', ns .. ':dl', n, now)
    elseif now - tonumber(dl) >= older then out[#out + 1] = n end
  end
end
return out

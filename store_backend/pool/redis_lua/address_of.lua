-- ARGV: ns, nodes. Returns {node, info json, ...} for the live ones.
local out = {}
for i = 1, #L do
  local n = L[i]
  if redis.call('EXISTS', ns .. ':live:' .. n) == 1 then
    local info = redis.call('GET', ns .. ':info:' .. n)
    if info then out[#out + 1] = n; out[#out + 1] = info end
  end
end
return out

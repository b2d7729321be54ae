-- ARGV: ns, ''. Returns {node, info json, alive 0/1, ...} flattened.
local out = {}
local members = redis.call('SMEMBERS', ns .. ':nodes')
for i = 1, #members do
  local n = members[i]
  local info = redis.call('GET', ns .. ':info:' .. n)
  if info then
    out[#out + 1] = n
    out[#out + 1] = info
    out[#out + 1] = redis.call('EXISTS', ns .. ':live:' .. n)
  end
end
return out

-- ARGV: ns, exclude ('' for none), keys. Returns one JSON text, list[list[Location]], each list
-- best first: the client decodes it in one msgspec call, no Python work per key. Ordering: tier
-- rank, then node id byte by byte (UTF-8 byte order is code point order, as Python sorts; Lua's
-- own string < follows the server's locale, so it is not used).
local byte, sub = string.byte, string.sub
local function before(na, va, nb, vb)
  local ra, rb = byte(va, 1), byte(vb, 1)
  if ra ~= rb then return ra < rb end
  local la, lb = #na, #nb
  for c = 1, math.min(la, lb) do
    local x, y = byte(na, c), byte(nb, c)
    if x ~= y then return x < y end
  end
  return la < lb
end
local out = {}
local call, prefix = redis.call, ns .. ':k:'
for i = 1, #L do
  local h = call('HGETALL', prefix .. L[i])
  local picked = {}
  for j = 1, #h, 2 do
    if alive(h[j]) then picked[#picked + 1] = j end
  end
  local n = #picked
  if n == 0 then
    out[i] = '[]'
  elseif n == 1 then
    out[i] = '[' .. sub(h[picked[1] + 1], 2) .. ']'
  elseif n == 2 then
    local x, y = picked[1], picked[2]
    if before(h[y], h[y + 1], h[x], h[x + 1]) then x, y = y, x end
    out[i] = '[' .. sub(h[x + 1], 2) .. ',' .. sub(h[y + 1], 2) .. ']'
  else
    table.sort(picked, function(x, y) return before(h[x], h[x + 1], h[y], h[y + 1]) end)
    local parts = {}
    for m = 1, n do parts[m] = sub(h[picked[m] + 1], 2) end
    out[i] = '[' .. table.concat(parts, ',') .. ']'
  end
end
return '[' .. table.concat(out, ',') .. ']'

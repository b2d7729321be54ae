-- ARGV: ns, exclude, keys. Returns the length of the leading run with a live holder.
local n = 0
local call, prefix = redis.call, ns .. ':k:'
for i = 1, #L do
  local h = call('HKEYS', prefix .. L[i])
  local found = false
  for j = 1, #h do
    if alive(h[j]) then found = true; break end
  end
  if not found then break end
  n = n + 1
end
return n

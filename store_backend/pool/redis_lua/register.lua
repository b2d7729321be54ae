-- ARGV: ns, node, skew_ms, key/packed/stored_ms triples. Returns {gen, refused keys}.
local node = ARGV[2]
local skew = tonumber(ARGV[3])
local nk = ns .. ':nk:' .. node
local out, changed = {}, {}
for i = 1, #L, 3 do
  local key, packed = L[i], L[i + 1]
  if refused(key, node, tonumber(L[i + 2]), skew) then
    out[#out + 1] = key
  else
    redis.call('HDEL', ns .. ':p:' .. key, node)
    store_location(key, node, packed, nk, changed)
  end
end
local gen = redis.call('INCR', ns .. ':gen:' .. node)
publish(changed)
return {gen, out}

-- ARGV: ns, node, skew_ms, key/packed/stored_ms triples. Returns {gen, 0/1 per key}.
local node = ARGV[2]
local skew = tonumber(ARGV[3])
local nk = ns .. ':nk:' .. node
local now = now_ms()
local out, changed = {}, {}
for i = 1, #L, 3 do
  local key, packed = L[i], L[i + 1]
  local pk = ns .. ':p:' .. key
  local d = redis.call('HGET', pk, node)
  local ok = 0
  if d then
    redis.call('HDEL', pk, node)
    if tonumber(d) > now and not refused(key, node, tonumber(L[i + 2]), skew) then
      store_location(key, node, packed, nk, changed)
      ok = 1
    end
  end
  out[#out + 1] = ok
end
local gen = redis.call('INCR', ns .. ':gen:' .. node)
publish(changed)
return {gen, out}

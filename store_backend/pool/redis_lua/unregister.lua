-- ARGV: ns, node, keys. Returns gen.
local node = ARGV[2]
local nk = ns .. ':nk:' .. node
local dropped = {}
for i = 1, #L do
  local key = L[i]
  if redis.call('HDEL', ns .. ':k:' .. key, node) == 1 then
    redis.call('SREM', nk, key)
    dropped[#dropped + 1] = key
  end
end
local gen = redis.call('INCR', ns .. ':gen:' .. node)
publish(dropped)
return gen

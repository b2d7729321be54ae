-- ARGV: ns, node, keys.
local node = ARGV[2]
for i = 1, #L do redis.call('HDEL', ns .. ':p:' .. L[i], node) end
return 0

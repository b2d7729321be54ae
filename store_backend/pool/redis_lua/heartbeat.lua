-- ARGV: ns, node, ttl_ms, info json. Returns {known 0/1, gen}.
local ns = ARGV[1]
local node = ARGV[2]
local lk = ns .. ':live:' .. node
local known = redis.call('EXISTS', lk)
local ttl = tonumber(ARGV[3])
redis.call('SET', lk, '1', 'PX', ttl)
local t = redis.call('TIME')
redis.call('HSET', ns .. ':dl', node, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl)
redis.call('SET', ns .. ':info:' .. node, ARGV[4])
redis.call('SADD', ns .. ':nodes', node)
local gen = redis.call('GET', ns .. ':gen:' .. node)
return {known, tonumber(gen or '0')}

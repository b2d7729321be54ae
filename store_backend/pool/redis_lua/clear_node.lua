-- ARGV: ns, node, mode ('0': locations only; '1': also drop the node's mark, info and counter;
-- '2': as '1', only while the node is dead), chunk, ''. Drops at most `chunk` of the node's
-- locations per call (a script holds Redis); returns {dropped, done 1 / more 0 / alive -1}.
local node = ARGV[2]
local mode = ARGV[3]
local chunk = tonumber(ARGV[4])
local nk = ns .. ':nk:' .. node
if mode == '2' and redis.call('EXISTS', ns .. ':live:' .. node) == 1 then return {0, -1} end
local keys = redis.call('SPOP', nk, chunk)
for i = 1, #keys do redis.call('HDEL', ns .. ':k:' .. keys[i], node) end
publish(keys)
if #keys >= chunk then return {#keys, 0} end
if mode ~= '0' then
  redis.call('DEL', ns .. ':live:' .. node, ns .. ':info:' .. node, ns .. ':gen:' .. node)
  redis.call('SREM', ns .. ':nodes', node)
  redis.call('HDEL', ns .. ':dl', node)
else
  redis.call('INCR', ns .. ':gen:' .. node)
end
return {#keys, 1}

-- ARGV: ns, tombstone_ms, keys. Returns {key, {holders}, ...} for the keys that had any.
local tomb = tonumber(ARGV[2])
local removed_at = tostring(now_ms())
local out, dropped = {}, {}
for i = 1, #L do
  local key = L[i]
  if tomb > 0 then redis.call('SET', ns .. ':t:' .. key, removed_at, 'PX', tomb) end
  local holders = drop_key(key)
  if #holders > 0 then
    out[#out + 1] = key
    out[#out + 1] = holders
    dropped[#dropped + 1] = key
  end
end
publish(dropped)
return out

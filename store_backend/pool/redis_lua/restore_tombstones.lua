-- ARGV: ns, (key, removed_at ms, ttl ms) triples. Sets each tombstone that is not there, and
-- drops that key's locations and pending marks as _REMOVE does; returns {key, {holders}, ...} for
-- the keys whose tombstone was set.
local out, dropped = {}, {}
for i = 1, #L, 3 do
  local key = L[i]
  local tk = ns .. ':t:' .. key
  if tonumber(L[i + 2]) > 0 and redis.call('EXISTS', tk) == 0 then
    redis.call('SET', tk, L[i + 1], 'PX', L[i + 2])
    local holders = drop_key(key)
    if #holders > 0 then dropped[#dropped + 1] = key end
    out[#out + 1] = key
    out[#out + 1] = holders
  end
end
publish(dropped)
return out

-- ARGV: ns, node, ttl_ms, skew_ms, key/stored_ms pairs. Returns a 0/1 per key.
local node = ARGV[2]
local ttl = tonumber(ARGV[3])
local skew = tonumber(ARGV[4])
local now = now_ms()
local out = {}
for i = 1, #L, 2 do
  local key = L[i]
  local ok = 0
  if redis.call('HEXISTS', ns .. ':k:' .. key, node) == 0 and not refused(key, node, tonumber(L[i + 1]), skew) then
    local pk = ns .. ':p:' .. key
    local d = redis.call('HGET', pk, node)
    if not d or tonumber(d) <= now then
      redis.call('HSET', pk, node, now + ttl)
      if redis.call('PTTL', pk) < ttl then redis.call('PEXPIRE', pk, ttl) end
      ok = 1
    end
  end
  out[#out + 1] = ok
end
return out

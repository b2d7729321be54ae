-- Shared by every script but heartbeat (prepended by directory_redis.py). ARGV[1] is always the
-- namespace; a script's list of keys (or key, value pairs) comes as its last argument, NUL-joined.
-- {{PUBLISH_CHUNK}} is replaced by the keys per invalidation message.
local ns = ARGV[1]
-- A packed list is '' (no items) or NUL + the items NUL-joined, so [""] is "\0", not ''.
local function split(s)
  local out = {}
  if s == nil or s == '' then return out end
  local i = 2
  while true do
    local j = string.find(s, '\0', i, true)
    if not j then out[#out + 1] = string.sub(s, i); return out end
    out[#out + 1] = string.sub(s, i, j - 1)
    i = j + 1
  end
end
local L = split(ARGV[#ARGV])
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function publish(keys)
  local n = #keys
  local i = 1
  while i <= n do
    local j = math.min(n, i + {{PUBLISH_CHUNK}} - 1)
    redis.call('PUBLISH', ns .. ':inval', table.concat(keys, '\0', i, j))
    i = j + 1
  end
end
-- A stored location is its tier rank (one digit) then its JSON ["node","tier",size,checksum]:
-- the same object when size and checksum agree (a tier move is not a new object).
local function object_of(stored)
  return string.match(stored, ',(%-?%d+,%-?%d+)%]$')
end
-- A removed key (remove, restore_tombstones): its pending marks and locations dropped (an
-- in-flight replica write must not become visible afterwards); returns the nodes that held it.
local function drop_key(key)
  redis.call('DEL', ns .. ':p:' .. key)
  local kk = ns .. ':k:' .. key
  local holders = redis.call('HKEYS', kk)
  if #holders > 0 then
    redis.call('DEL', kk)
    for j = 1, #holders do redis.call('SREM', ns .. ':nk:' .. holders[j], key) end
  end
  return holders
end
-- The remove rule (directory.py): refused when the node has no location for the key and a
-- tombstone's removed_at (ms, this server's clock) is >= the copy's stored_at - skew (ms).
local function refused(key, node, stored, skew)
  if redis.call('HEXISTS', ns .. ':k:' .. key, node) == 1 then return false end
  local t = redis.call('GET', ns .. ':t:' .. key)
  if not t then return false end
  return tonumber(t) >= stored - skew
end
-- Store ``packed`` as ``node``'s location of ``key`` (nk: the node's key set); a key whose object
-- changed (not a tier move) is appended to ``changed`` for the invalidation message.
local function store_location(key, node, packed, nk, changed)
  local kk = ns .. ':k:' .. key
  local old = redis.call('HGET', kk, node)
  redis.call('HSET', kk, node, packed)
  redis.call('SADD', nk, key)
  if old and object_of(old) ~= object_of(packed) then changed[#changed + 1] = key end
end

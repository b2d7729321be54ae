local exclude = ARGV[2]
local live = {}
local function alive(n)
  local v = live[n]
  if v == nil then
    v = n ~= exclude and redis.call('EXISTS', ns .. ':live:' .. n) == 1
    live[n] = v
  end
  return v
end

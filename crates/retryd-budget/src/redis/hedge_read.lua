-- Sums an upstream's hedging window: every slot key still inside it.
-- KEYS     the window's slot keys (one hash tag: one Cluster slot).
-- Returns  a flat list of field, total pairs ("n", "h", "<bucket>").
local totals = {}
for _, key in ipairs(KEYS) do
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    local field = fields[i]
    totals[field] = (totals[field] or 0) + tonumber(fields[i + 1])
  end
end
local reply = {}
for field, total in pairs(totals) do
  reply[#reply + 1] = field
  reply[#reply + 1] = total
end
return reply

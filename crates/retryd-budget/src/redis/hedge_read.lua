-- Sums an upstream's hedging window: every slot key still inside it.
-- KEYS     the window's slot keys, the newest first (one hash tag: one
--          Cluster slot).
-- ARGV[1]  how many of the newest keys are the window's recent part.
-- Returns  a flat list of field, total pairs ("n", "h", "<bucket>"), then
--          the recent part's latencies as "r<bucket>".
local recent = tonumber(ARGV[1]) or 0
local totals = {}
for index, key in ipairs(KEYS) do
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    local field = fields[i]
    local count = tonumber(fields[i + 1])
    totals[field] = (totals[field] or 0) + count
    if index <= recent and field ~= 'n' and field ~= 'h' then
      local named = 'r' .. field
      totals[named] = (totals[named] or 0) + count
    end
  end
end
local reply = {}
for field, total in pairs(totals) do
  reply[#reply + 1] = field
  reply[#reply + 1] = total
end
return reply

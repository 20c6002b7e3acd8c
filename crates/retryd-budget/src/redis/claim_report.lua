-- Claims a traffic report's id (see reports.rs in the crate for the states).
-- KEYS[1]: the id's key. ARGV: the report's digest, its number of entries,
-- the window to remember the id (ms), the lease of an unsettled claim (ms).
-- The value is "p:<digest>:<claimed at, ms>" while in progress, then
-- "d:<digest>:<entries applied>". Returns {state, applied}: 0 fresh,
-- 1 seen (resume after `applied`), 2 in progress elsewhere, 3 conflict.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local claimed = 'p:' .. ARGV[1] .. ':' .. now
local value = redis.call('GET', KEYS[1])
if not value then
  redis.call('SET', KEYS[1], claimed, 'PX', ARGV[3])
  return {0, 0}
end
local state, digest, number = string.match(value, '^(%a):([^:]+):(%d+)$')
if digest ~= ARGV[1] then
  return {3, 0}
end
if state == 'p' and now - tonumber(number) < tonumber(ARGV[4]) then
  return {2, 0}
end
-- Settled: resume after what was applied. A claim older than its lease
-- belongs to a replica that died mid-report: take everything as applied.
local applied = tonumber(ARGV[2])
if state == 'd' then
  applied = tonumber(number)
end
redis.call('SET', KEYS[1], claimed, 'KEEPTTL')
return {1, applied}

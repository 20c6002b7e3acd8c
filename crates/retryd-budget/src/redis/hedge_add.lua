-- Adds one replica's hedging counts to one slot of an upstream's window.
-- KEYS[1]  {prefix}:{u:<name>}:hedge:<slot>, a hash: "n" first attempts,
--          "h" hedges granted, "<bucket>" latencies in that bucket.
-- ARGV[1]  the key's time to live, in milliseconds (twice the window).
-- ARGV[2]  first attempts; ARGV[3] hedges; then bucket, count pairs.
local key = KEYS[1]
if tonumber(ARGV[2]) > 0 then
  redis.call('HINCRBY', key, 'n', ARGV[2])
end
if tonumber(ARGV[3]) > 0 then
  redis.call('HINCRBY', key, 'h', ARGV[3])
end
for i = 4, #ARGV, 2 do
  redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', key, ARGV[1])
return 1

-- Lease: hand back the replica's previous lease ARGV[8] ("<id>:<units>", or
-- "" for none) with ARGV[9] units unspent, then move min(ARGV[6], whole
-- tokens held) units out of the bucket into lease ARGV[5] that lives ARGV[7]
-- ms. Result: the units leased.
--
-- Handing the previous lease back here frees the room it occupied without
-- a round trip of its own; like a release, it counts only while live.
refill()
local previous = ARGV[8]
if previous ~= '' and redis.call('ZREM', KEYS[3], previous) == 1 then
  local leased = tonumber(string.match(previous, ':(%d+)$')) or 0
  room = math.min(cap, room + leased)
  lease_back(leased)
  add(math.min(tonumber(ARGV[9]), leased))
end
local take = math.min(tonumber(ARGV[6]), math.floor(tokens / UNIT) * UNIT)
if take > 0 then
  local ttl = tonumber(ARGV[7])
  tokens = tokens - take
  redis.call('ZADD', KEYS[3], int(now_ms + ttl), ARGV[5] .. ':' .. int(take))
  lease_out(take, now_ms + ttl)
  if redis.call('PTTL', KEYS[3]) < ttl then
    redis.call('PEXPIRE', KEYS[3], ttl)
  end
end
return reply(take, save())

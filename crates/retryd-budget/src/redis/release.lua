-- Return lease ARGV[5] ("<id>:<units>") with ARGV[6] units unspent. Only a
-- live lease is credited, once: an expired lease was spent, and a second
-- return of the same lease finds nothing. Result: the units credited.
local removed = redis.call('ZREM', KEYS[3], ARGV[5])
if removed == 0 then
  refill()
  return reply(0, nil)
end
local leased = tonumber(string.match(ARGV[5], ':(%d+)$')) or 0
-- Refill within the room the lease occupied, as time went by, then free it.
refill()
room = math.min(cap, room + leased)
lease_back(leased)
local before = tokens
add(math.min(tonumber(ARGV[6]), leased))
return reply(tokens - before, save())

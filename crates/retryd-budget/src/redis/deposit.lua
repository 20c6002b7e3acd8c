-- Deposit ARGV[5] units, capped at the room left.
refill()
add(tonumber(ARGV[5]))
return reply(0, save())

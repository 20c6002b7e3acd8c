-- Withdraw one whole token if there is one; result 1 if granted.
refill()
local granted = 0
if tokens >= UNIT then
  tokens = tokens - UNIT
  granted = 1
end
return reply(granted, save())

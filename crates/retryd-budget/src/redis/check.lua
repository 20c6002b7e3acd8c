-- Check: a decision's one script. Refill; if ARGV[5] is "1", withdraw one
-- whole token when there is one and retries are on. Result 1 if granted.
-- Saved like a withdrawal (the refill too) when asked to withdraw, like a
-- view (nothing) otherwise.
refill()
if ARGV[5] ~= '1' then
  return reply(0, nil)
end
local granted = 0
if enabled and tokens >= UNIT then
  tokens = tokens - UNIT
  granted = 1
end
return reply(granted, save())

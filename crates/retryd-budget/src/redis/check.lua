-- Check: a decision's one script. Refill; write the pushback this call
-- announces (ARGV[6] wait, ARGV[7] stop window, in ms; 0 for none), "set if
-- later"; if ARGV[5] is "1", withdraw one whole token when there is one,
-- retries are on, no stop window is in force and the earliest-retry time in
-- force is at most ARGV[8] ms away (-1: any; a longer wait is a DEADLINE
-- denial, which spends nothing), and the recovery ramp (window ARGV[10] ms)
-- admits the decision's draw ARGV[9] (below its share). Result 1 if granted.
-- Saved like a withdrawal (the refill too) when asked to withdraw; like a
-- view (nothing) otherwise, but for an announced pushback.
refill()
local announced = announce(tonumber(ARGV[6]) or 0, tonumber(ARGV[7]) or 0)
if ARGV[5] ~= '1' then
  if announced then
    save_pushback()
  end
  return reply(0, nil)
end
local granted = 0
local patience = tonumber(ARGV[8]) or -1
local share = ramp_share(tonumber(ARGV[10]) or 0)
local admitted = share >= 1 or (tonumber(ARGV[9]) or 0) < share
if enabled and tokens >= UNIT and not stopped() and (patience < 0 or pb0 - now_ms <= patience)
    and admitted then
  tokens = tokens - UNIT
  granted = 1
end
return reply(granted, save())

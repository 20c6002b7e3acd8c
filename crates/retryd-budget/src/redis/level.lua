-- Level: note the adaptive budget's level of a report's entry, ARGV[5] in
-- millionths; one at or above ARGV[6] (the low level, in millionths) after
-- one below it starts a recovery ramp now.
local before = lv
lv = tonumber(ARGV[5])
if before < tonumber(ARGV[6]) and lv >= tonumber(ARGV[6]) then
  rs = now_ms
end
return reply(0, save())

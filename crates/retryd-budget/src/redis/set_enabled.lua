-- Kill switch: ARGV[5] is '1' (retries on) or '0' (off); result: the
-- previous state (1 on).
local was = 0
if enabled then
  was = 1
end
if ARGV[5] == '1' then
  redis.call('DEL', KEYS[2])
  enabled = true
else
  redis.call('SET', KEYS[2], '1')
  enabled = false
end
refill()
return reply(was, save())

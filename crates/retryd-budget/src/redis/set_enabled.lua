-- Kill switch: ARGV[5] is '1' (retries on) or '0' (off); result: the
-- previous state (1 on). Switched back on: a recovery ramp begins now.
local was = 0
if enabled then
  was = 1
end
if ARGV[5] == '1' then
  redis.call('DEL', KEYS[2])
  if not enabled then
    rs = now_ms
  end
  enabled = true
else
  redis.call('SET', KEYS[2], '1')
  enabled = false
end
refill()
return reply(was, save())

-- All-or-nothing admission of several upstreams to the index (see
-- admit.lua), for a traffic report: KEYS[1] the index, ARGV[1] the limit,
-- ARGV[2] the lifetime of an entry in ms, ARGV[3..] distinct names. The
-- new names are added only if they all fit under the limit together; else
-- nothing changes. A known entry that would lapse sooner than a new one is
-- extended to the same lifetime, so that no entry lapses between this
-- admission and the deposits that follow it (a longer entry only holds its
-- place longer). Result {1, now_ms, score of each name (-1 for +inf)}, or
-- {0, now_ms} if refused.
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now_ms))
local expiry = now_ms + tonumber(ARGV[2])
local scores = {}
local new = 0
for i = 3, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if not score then
    new = new + 1
    scores[i] = false
  elseif score == 'inf' or tonumber(score) == math.huge then
    scores[i] = -1
  else
    scores[i] = tonumber(score)
  end
end
if new > 0 and redis.call('ZCARD', KEYS[1]) + new > tonumber(ARGV[1]) then
  return {0, now_ms}
end
local reply = {1, now_ms}
for i = 3, #ARGV do
  local score = scores[i]
  if score == false or (score >= 0 and score < expiry) then
    redis.call('ZADD', KEYS[1], string.format('%d', expiry), ARGV[i])
    score = expiry
  end
  reply[#reply + 1] = score
end
return reply

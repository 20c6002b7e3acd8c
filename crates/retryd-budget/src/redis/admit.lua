-- The index of tracked upstreams (one sorted set, member = upstream name,
-- score = server ms after which the entry lapses, +inf while retries are
-- off). Admit ARGV[1] if known or if fewer than ARGV[2] are tracked; a new
-- entry lives ARGV[3] ms. Result {admitted, score (-1 for +inf), now_ms}.
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now_ms))
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score then
  if score == 'inf' or tonumber(score) == math.huge then
    return {1, -1, now_ms}
  end
  return {1, tonumber(score), now_ms}
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return {0, 0, now_ms}
end
local expiry = now_ms + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], string.format('%d', expiry), ARGV[1])
return {1, expiry, now_ms}

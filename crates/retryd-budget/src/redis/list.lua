-- The live entries of the index, lapsed ones pruned first.
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now_ms))
return redis.call('ZRANGE', KEYS[1], 0, -1)

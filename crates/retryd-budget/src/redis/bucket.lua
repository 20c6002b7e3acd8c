-- The prelude of every bucket script: one upstream's keys, never another's.
--
-- KEYS[1] bucket hash {tokens, us, ns}: tokens in units (1e6 per token), and
--         the instant up to which the floor is credited, as whole
--         microseconds of Redis server time plus a nanosecond remainder
--         (Lua numbers are doubles: nanoseconds since 1970 would not be exact).
-- KEYS[2] kill switch: exists while retries are off. It never expires.
-- KEYS[3] live leases: sorted set, member "<lease id>:<units>", score = expiry
--         in server milliseconds. Leased units count against the capacity.
-- ARGV[1] capacity units, ARGV[2] initial units, ARGV[3] floor in units per
--         nanosecond (the exact double Rust computed), ARGV[4] least idle TTL
--         in milliseconds. Further ARGV belong to the operation.
--
-- The arithmetic is BucketConfig::refill's, on the same doubles: credit only
-- whole units, and consume only the time those units account for.
local UNIT = 1000000
local cap = tonumber(ARGV[1])
local init = math.min(tonumber(ARGV[2]), cap)
local upn = tonumber(ARGV[3])
local idle_ttl = tonumber(ARGV[4])

local function int(n)
  return string.format('%d', n)
end

local clock = redis.call('TIME')
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local now_ms = math.floor(now_us / 1000)

-- Expired leases are spent: drop them; live ones occupy room in the bucket.
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. int(now_ms))
local out = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  out = out + (tonumber(string.match(member, ':(%d+)$')) or 0)
end
local room = math.max(cap - out, 0)

local state = redis.call('HMGET', KEYS[1], 'tokens', 'us', 'ns')
local existed = state[1] ~= false
local tokens, us, ns
if existed then
  tokens, us, ns = tonumber(state[1]), tonumber(state[2]), tonumber(state[3])
else
  tokens, us, ns = init, now_us, 0
end
tokens = math.min(tokens, room)
local enabled = redis.call('EXISTS', KEYS[2]) == 0

local function add(units)
  tokens = math.min(tokens + units, room)
end

local function refill()
  local elapsed = (now_us - us) * 1000 - ns
  if elapsed <= 0 then
    return
  end
  local units, nanos
  if not (upn > 0) then
    units, nanos = 0, elapsed
  else
    units = math.floor(elapsed * upn)
    nanos = math.min(math.ceil(units / upn), elapsed)
  end
  if nanos == 0 then
    return
  end
  local total = ns + nanos
  us = us + math.floor(total / 1000)
  ns = total % 1000
  if units > 0 then
    add(units)
  end
end

-- Saves the bucket with an expiry after which re-creating it at `init` can
-- never give more than it would have held: the time the floor needs to bring
-- it back to `init` (plus a unit and a second of slack), at least `idle_ttl`.
-- Without a floor a bucket below `init` never refills by itself, so it never
-- expires. Returns the TTL in ms, or -1 for none.
local function save()
  redis.call('HSET', KEYS[1], 'tokens', int(tokens), 'us', int(us), 'ns', int(ns))
  local ttl = idle_ttl
  if tokens < init then
    if upn > 0 then
      ttl = math.max(idle_ttl, math.ceil((init - tokens + 1) / upn / 1000000) + 1000)
      if ttl > 1e12 then
        ttl = -1
      end
    else
      ttl = -1
    end
  end
  if ttl < 0 then
    redis.call('PERSIST', KEYS[1])
  else
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  return ttl
end

-- {result, tokens, enabled, tracked, index, now_ms}; index: -1 retries off,
-- -2 nothing saved, -3 saved without expiry, else the bucket's expiry (ms).
local function reply(result, ttl)
  local index
  if not enabled then
    index = -1
  elseif ttl == nil then
    index = -2
  elseif ttl < 0 then
    index = -3
  else
    index = now_ms + ttl
  end
  local tracked = 0
  if existed or not enabled then
    tracked = 1
  end
  local on = 0
  if enabled then
    on = 1
  end
  return {result, tokens, on, tracked, index, now_ms}
end

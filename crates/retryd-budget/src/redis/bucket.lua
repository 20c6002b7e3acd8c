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

-- The bucket hash caches what would otherwise cost a command per call: the
-- units leased out (`out`) and the earliest live lease's expiry (`lexp`),
-- the kill switch (`off`), and the key's expiry (`exp`). A missing field
-- (a new bucket, or one written by an older retryd) means "read it from
-- the source", so the slow path is also the upgrade path; in steady state a
-- decision runs TIME, HMGET and HSET only (issue 19: <= 4 commands with the
-- EVALSHA). `pb` and `ps` are the upstream's fleet-wide pushback (issue 32,
-- pushback.rs): the earliest-retry time and the end of a stop window, in
-- server ms (absent or past: none). They ride in the same hash so that a
-- decision reads them with the same HMGET. `rs` is when the last recovery
-- ramp began (server ms; absent: never) and `lv` the adaptive level last
-- noted, in millionths (absent: 1).
local state = redis.call('HMGET', KEYS[1], 'tokens', 'us', 'ns', 'out', 'lexp', 'off', 'exp',
  'pb', 'ps', 'rs', 'lv')
local existed = state[1] ~= false
local tokens, us, ns
if existed then
  tokens, us, ns = tonumber(state[1]), tonumber(state[2]), tonumber(state[3])
else
  tokens, us, ns = init, now_us, 0
end

-- Expired leases are spent: drop them; live ones occupy room in the bucket.
-- The set is read only when the cache is unknown or a cached lease may have
-- expired (`lexp` is a lower bound: a lease returned early leaves it as it
-- was, which costs one needless rescan, never a wrong count).
local out, lexp = tonumber(state[4]), tonumber(state[5])
if out == nil or lexp == nil or (out > 0 and lexp < now_ms) then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. int(now_ms))
  out, lexp = 0, 0
  local members = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
  for i = 1, #members, 2 do
    out = out + (tonumber(string.match(members[i], ':(%d+)$')) or 0)
  end
  -- Ascending by score: the first is the earliest expiry.
  if #members > 0 then
    lexp = tonumber(members[2])
  end
end
-- The pushback as read, before any announcement of this call: what the
-- reply tells, so the caller can tell another caller's pushback from its own.
local pb0, ps0 = tonumber(state[8]) or 0, tonumber(state[9]) or 0
local pb, ps = pb0, ps0

-- Writes a pushback "set if later" (milliseconds from now, 0 for none);
-- true if it moved anything.
local function announce(wait_ms, stop_ms)
  local moved = false
  if wait_ms > 0 and now_ms + wait_ms > pb then
    pb = now_ms + wait_ms
    moved = true
  end
  if stop_ms > 0 and now_ms + stop_ms > ps then
    ps = now_ms + stop_ms
    moved = true
  end
  return moved
end

local rs0 = tonumber(state[10]) or 0
local lv0 = tonumber(state[11]) or UNIT
local rs, lv = rs0, lv0

-- The recovery ramp's share now, over a window of `window_ms` (0: none):
-- (now − rs) / window, capped at 1; the same doubles as Rust's.
local function ramp_share(window_ms)
  if rs <= 0 or window_ms <= 0 then
    return 1
  end
  local elapsed = math.max(now_ms - rs, 0)
  if elapsed >= window_ms then
    return 1
  end
  return elapsed / window_ms
end

-- True while a stop window is in force: no token is withdrawn.
local function stopped()
  return ps0 > now_ms
end
local room = math.max(cap - out, 0)
tokens = math.min(tokens, room)

local enabled
if state[6] == '0' then
  enabled = true
elseif state[6] == '1' then
  enabled = false
else
  enabled = redis.call('EXISTS', KEYS[2]) == 0
end

-- A lease taken (`units` out until `expiry`) or handed back, in the cache.
local function lease_out(units, expiry)
  if out == 0 or lexp == 0 or expiry < lexp then
    lexp = expiry
  end
  out = out + units
end

local function lease_back(units)
  out = math.max(out - units, 0)
end

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
-- expires. The key's expiry is moved only when it would fall short of that,
-- and then to 1.5 times it, so that a busy bucket runs PEXPIRE about once a
-- third of its TTL rather than on every write (a later expiry never
-- over-grants; it only keeps an idle bucket longer). Returns the key's
-- expiry in server ms, or -1 for none.
local function save()
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
  -- The key outlives the pushback it holds.
  local hold = math.max(pb, ps) - now_ms
  if ttl >= 0 and hold > ttl then
    ttl = hold
  end
  local expiry = tonumber(state[7])
  local command = nil
  if ttl < 0 then
    if expiry ~= -1 then
      command = 'PERSIST'
    end
    expiry = -1
  elseif expiry == nil or expiry < 0 or expiry < now_ms + ttl then
    ttl = ttl + math.floor(ttl / 2)
    command = 'PEXPIRE'
    expiry = now_ms + ttl
  end
  local off = '0'
  if not enabled then
    off = '1'
  end
  -- The pushback and ramp fields only when they moved: most buckets never
  -- have them, and formatting and writing four more fields on every
  -- decision was a quarter more Redis CPU (BENCHMARKS.md).
  local moved = {}
  if pb ~= pb0 then
    moved[#moved + 1] = 'pb'
    moved[#moved + 1] = int(pb)
  end
  if ps ~= ps0 then
    moved[#moved + 1] = 'ps'
    moved[#moved + 1] = int(ps)
  end
  if rs ~= rs0 then
    moved[#moved + 1] = 'rs'
    moved[#moved + 1] = int(rs)
  end
  if lv ~= lv0 then
    moved[#moved + 1] = 'lv'
    moved[#moved + 1] = int(lv)
  end
  redis.call('HSET', KEYS[1], 'tokens', int(tokens), 'us', int(us), 'ns', int(ns),
    'out', int(out), 'lexp', int(lexp), 'off', off, 'exp', int(expiry), unpack(moved))
  if command == 'PERSIST' then
    redis.call('PERSIST', KEYS[1])
  elseif command == 'PEXPIRE' then
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  return expiry
end

-- Saves only the pushback (a call that saves nothing else), on a hash that
-- may hold nothing more: its key then expires with the pushback, and an
-- existing bucket's expiry is moved only if it would fall short of it.
local function save_pushback()
  redis.call('HSET', KEYS[1], 'pb', int(pb), 'ps', int(ps))
  local until_ms = math.max(pb, ps)
  local expiry = tonumber(state[7])
  if not existed then
    redis.call('PEXPIREAT', KEYS[1], int(until_ms + 1000))
  elseif expiry == nil or (expiry >= 0 and expiry < until_ms) then
    redis.call('PEXPIREAT', KEYS[1], int(until_ms + 1000))
    redis.call('HSET', KEYS[1], 'exp', int(until_ms + 1000))
  end
end

-- {result, tokens, enabled, tracked, index, now_ms, pb, ps, rs, lv}; pb and
-- ps as read (see above); index: -1 retries off,
-- -2 nothing saved, -3 saved without expiry, else the bucket's expiry (ms).
local function reply(result, expiry)
  local index
  if not enabled then
    index = -1
  elseif expiry == nil then
    index = -2
  elseif expiry < 0 then
    index = -3
  else
    index = expiry
  end
  local tracked = 0
  if existed or not enabled then
    tracked = 1
  end
  local on = 0
  if enabled then
    on = 1
  end
  return {result, tokens, on, tracked, index, now_ms, pb0, ps0, rs, lv}
end

// The sick upstream of the fleet scenarios: a plain Node.js HTTP server on
// 127.0.0.1 with a safe read (GET /items/:id) and two writes:
//   POST /charges        non-idempotent: no idempotency store, every charge it
//                        accepts is applied; it records the caller's
//                        Idempotency-Key (one per logical payment) with each,
//                        so a payment charged twice is counted as a duplicate;
//   POST /keyed-charges  honours the key: a key already applied is answered
//                        from the record (counted as a replay), not charged
//                        again, so a caller may declare it IDEMPOTENT_WITH_KEY. The runner drives its faults and reads its
// counters over /_control and /_stats (never counted as traffic).
//
//   node fleet/upstream.mjs            prints {"port": N} once listening
//
// Faults (POST /_control {"fault": ...}):
//   {"mode": "ok"}                     healthy
//   {"mode": "outage"}                 every request 503, nothing applied
//   {"mode": "partial", "p": 0.3}      that fraction 503 (nothing applied), the rest served
//   {"mode": "latency", "delay_ms": D} the charge is applied at once, the
//                                      response held D ms (beyond the callers'
//                                      timeouts, so they cannot know it happened)
//   {"mode": "delay", "base_ms": B, "jitter_ms": J, "tail_p": P, "tail_ms": T, "seed": S}
//                                      the tail scenario (fleet/tail.py): each
//                                      response held B +- J ms, or T ms for a
//                                      fraction P of them. Drawn from a hash of
//                                      (S, path, arrival index of that path), not
//                                      from arrival order, so every strategy of a
//                                      run meets the same slow first attempts
//                                      while a second copy of a call (a hedge)
//                                      draws afresh. The response says which
//                                      arrival it was (x-fleet-copy: 1, 2, ...).
//   {"mode": "pushback", "retry_after_s": 2}
//                                      every request 429 with that Retry-After,
//                                      nothing applied (the pushback scenario);
//                                      with "p503": P, that fraction 503 instead
// A request with `x-fleet-prev-ms` (the pushback scenario's callers tag each
// retry with the epoch-relative instant its previous attempt's answer came)
// is counted as a retry; it is early if it lands before the Retry-After
// deadline of the latest 429 served PUSHBACK_LAG_MS before that instant,
// which retryd had been told of when it decided the retry.
import { createHash } from 'node:crypto';
import http from 'node:http';

const BUCKET_MS = 250;
// A caller reports its 429 to retryd in its Decide right after the answer;
// this much slack covers that report reaching retryd before another caller's
// decision (loopback, a loaded 2-core machine).
const PUSHBACK_LAG_MS = 100;

let fault = { mode: 'ok' };
let epochMs = Date.now();
let buckets = new Map(); // bucket index -> counters
let charges = new Map(); // idempotency key -> times applied
let totals;
// Requests by their `x-fleet-tag` header (the layers scenario tags the calls
// its edges start inside the fault window, and every tier forwards the tag).
let tagged;
let faultLog = [];
// The delay mode's arrivals per path (one path per logical call there).
let arrivals = new Map();

/** Two uniform draws in [0, 1) for the n-th arrival of `path` under `seed`. */
function draws(seed, path, n) {
  const digest = createHash('sha256').update(`${seed}:${path}:${n}`).digest();
  return [digest.readUInt32BE(0) / 4294967296, digest.readUInt32BE(4) / 4294967296];
}
// The pushback fault's 429s: [served at (ms since epoch), deadline], in order.
let announced = [];

function reset(newEpochMs) {
  epochMs = newEpochMs;
  buckets = new Map();
  charges = new Map();
  totals = { requests: 0, get: 0, post: 0, rejected_503: 0, rejected_429: 0, retries: 0, early_retries: 0, early_ms_max: 0, applied: 0, duplicates: 0, replays: 0, missing_key: 0, in_flight_max: 0, repeats: 0, held_tail: 0 };
  tagged = {};
  faultLog = [];
  arrivals = new Map();
  announced = [];
}
reset(Date.now());
let inFlight = 0;

function bucket() {
  const index = Math.floor((Date.now() - epochMs) / BUCKET_MS);
  let counters = buckets.get(index);
  if (!counters) {
    counters = { requests: 0, get: 0, post: 0, rejected_503: 0, applied: 0, duplicates: 0, replays: 0, repeats: 0, held_tail: 0, rejected_429: 0, retries: 0, early_retries: 0 };
    buckets.set(index, counters);
  }
  return counters;
}

function count(field, counters) {
  counters[field] += 1;
  totals[field] += 1;
}

function readBody(request) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    request.on('data', (chunk) => chunks.push(chunk));
    request.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')));
    request.on('error', reject);
  });
}

function reply(response, status, body, copy) {
  const text = JSON.stringify(body);
  const headers = { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) };
  if (copy !== undefined) headers['x-fleet-copy'] = String(copy);
  // A response to a caller that gave up (its timeout passed) may fail: that
  // is the point of the latency fault, not an error of the server.
  try {
    response.writeHead(status, headers);
    response.end(text);
  } catch {
    /* the caller is gone */
  }
}

async function control(request, response) {
  const body = JSON.parse((await readBody(request)) || '{}');
  if (body.reset_epoch_ms !== undefined) reset(body.reset_epoch_ms);
  if (body.fault !== undefined) {
    fault = body.fault;
    faultLog.push({ t_ms: Date.now() - epochMs, fault });
  }
  reply(response, 200, { fault });
}

function stats(response) {
  const series = [...buckets.entries()].sort((a, b) => a[0] - b[0]).map(([index, counters]) => ({ bucket: index, ...counters }));
  let keysTwice = 0;
  for (const times of charges.values()) if (times > 1) keysTwice += 1;
  reply(response, 200, {
    bucket_ms: BUCKET_MS,
    epoch_ms: epochMs,
    totals: { ...totals, distinct_payments: charges.size, payments_charged_twice_or_more: keysTwice },
    series,
    tagged,
    fault_log: faultLog,
    // Every payment charged at least once, for the runner to compare with
    // what the callers believe happened to it.
    applied_keys: [...charges.keys()],
    cpu_us: process.cpuUsage(),
  });
}

// The deadline of the latest 429 served at or before `atMs`, or null.
function lastAnnouncedBefore(atMs) {
  let low = 0;
  let high = announced.length; // first index served after atMs
  while (low < high) {
    const mid = (low + high) >> 1;
    if (announced[mid][0] <= atMs) low = mid + 1;
    else high = mid;
  }
  return low === 0 ? null : announced[low - 1][1];
}

async function serve(request, response, keyed) {
  const counters = bucket();
  count('requests', counters);
  const tag = request.headers['x-fleet-tag'];
  if (typeof tag === 'string') tagged[tag] = (tagged[tag] ?? 0) + 1;
  const isPost = request.method === 'POST';
  count(isPost ? 'post' : 'get', counters);
  const body = isPost ? await readBody(request) : '';
  const current = fault;
  const prev = request.headers['x-fleet-prev-ms'];
  if (typeof prev === 'string') {
    count('retries', counters);
    const nowMs = Date.now() - epochMs;
    const known = lastAnnouncedBefore(Number(prev) - PUSHBACK_LAG_MS);
    if (known !== null && nowMs < known) {
      count('early_retries', counters);
      totals.early_ms_max = Math.max(totals.early_ms_max, known - nowMs);
    }
  }
  if (current.mode === 'pushback' && !(Math.random() < (current.p503 ?? 0))) {
    count('rejected_429', counters);
    const servedMs = Date.now() - epochMs;
    const retryAfter = current.retry_after_s ?? 2;
    announced.push([servedMs, servedMs + retryAfter * 1000]);
    const text = JSON.stringify({ error: 'too many requests' });
    try {
      response.writeHead(429, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text), 'retry-after': String(retryAfter) });
      response.end(text);
    } catch {
      /* the caller is gone */
    }
    return;
  }
  if (current.mode === 'outage' || current.mode === 'pushback' || (current.mode === 'partial' && Math.random() < current.p)) {
    // Rejected before any work: the charge is not applied.
    count('rejected_503', counters);
    reply(response, 503, { error: 'unavailable' });
    return;
  }
  if (isPost) {
    const key = request.headers['idempotency-key'];
    if (!key) {
      totals.missing_key += 1;
      reply(response, 400, { error: 'Idempotency-Key required' });
      return;
    }
    if (keyed && charges.has(key)) {
      // The key was applied (at arrival, below): answer from the record.
      count('replays', counters);
    } else {
      // Applied now, whatever happens to the response.
      const times = (charges.get(key) ?? 0) + 1;
      charges.set(key, times);
      count('applied', counters);
      if (times > 1) count('duplicates', counters);
    }
  }
  if (current.mode === 'latency') await new Promise((resolve) => setTimeout(resolve, current.delay_ms));
  let copy;
  if (current.mode === 'delay') {
    const path = request.url;
    copy = (arrivals.get(path) ?? 0) + 1;
    arrivals.set(path, copy);
    if (copy > 1) count('repeats', counters);
    const [tail, jitter] = draws(current.seed ?? 0, path, copy);
    const ms = tail < (current.tail_p ?? 0) ? current.tail_ms : current.base_ms + (2 * jitter - 1) * (current.jitter_ms ?? 0);
    if (tail < (current.tail_p ?? 0)) count('held_tail', counters);
    await new Promise((resolve) => setTimeout(resolve, ms));
  }
  reply(response, isPost ? 201 : 200, isPost ? { charged: JSON.parse(body || '{}').amount ?? 0 } : { id: request.url }, copy);
}

const server = http.createServer((request, response) => {
  inFlight += 1;
  totals.in_flight_max = Math.max(totals.in_flight_max, inFlight);
  response.on('close', () => {
    inFlight -= 1;
  });
  const route = request.url.split('?')[0];
  let handled;
  if (route === '/_control' && request.method === 'POST') handled = control(request, response);
  else if (route === '/_stats') handled = Promise.resolve(stats(response));
  else if ((route.startsWith('/items/') && request.method === 'GET') || (route === '/charges' && request.method === 'POST')) handled = serve(request, response, false);
  else if (route === '/keyed-charges' && request.method === 'POST') handled = serve(request, response, true);
  else handled = Promise.resolve(reply(response, 404, { error: 'no such route' }));
  handled.catch((error) => reply(response, 500, { error: String(error) }));
});
// Callers keep connections alive across calls, as HTTP clients do.
server.keepAliveTimeout = 30_000;
server.headersTimeout = 35_000;
server.listen(0, '127.0.0.1', () => {
  process.stdout.write(JSON.stringify({ port: server.address().port }) + '\n');
});
process.on('SIGTERM', () => server.close(() => process.exit(0)));
